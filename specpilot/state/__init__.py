"""The types and state the layers above share: batches, caches, requests, drafts, trees, transfers, graphs."""
