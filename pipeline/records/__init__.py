"""What a run records: the update log, the accounting audit, Parquet archives, metrics (JSONL, TensorBoard)."""
