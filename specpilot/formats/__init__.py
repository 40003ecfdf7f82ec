"""Weight formats: how a checkpoint's tensors are stored, and back to what the model computes with."""
