"""The samplers' side: generation engines (hf, vLLM) and the pacing decisions."""
