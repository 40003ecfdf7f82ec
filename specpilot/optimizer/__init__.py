"""The optimizer (DESIGN §8): each round the cost model ranks the gaps, search agents propose parameter
sets in their own processes, the sealed evaluator (a separate process) admits what exact forcing proves
lossless and interleaved runs prove faster, and the memory keeps it all."""
