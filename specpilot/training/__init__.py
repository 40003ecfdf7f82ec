"""Training a DFlash drafter for a target (`specpilot train-drafter`): the data (data.py) and the trainer
(train.py). Nothing at inference imports this package."""
