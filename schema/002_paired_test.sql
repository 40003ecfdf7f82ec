-- The evaluator's paired sign-flip test (optimizer/significance.py): the speedup's one-sided 95% lower bound,
-- the test's p-value, and the pairs it had.
ALTER TABLE validations ADD COLUMN speedup_lower REAL;
ALTER TABLE validations ADD COLUMN p_value REAL;
ALTER TABLE validations ADD COLUMN pairs INTEGER;
