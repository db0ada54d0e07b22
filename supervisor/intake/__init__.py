"""What users hand in: job files, LLaMA-Factory and DeepSpeed validation (pure), the spool (I/O)."""
