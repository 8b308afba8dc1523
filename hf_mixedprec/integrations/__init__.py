"""Integrations with Hugging Face Transformers, Accelerate and DeepSpeed (the only modules that import them)."""
