"""Task data: the task spec, demo corpora, splitting, tokenised batches, corruptions."""
