"""The LLM path of grove: causal LMs from transformers trained with group-relative RL on verifiable rewards."""
