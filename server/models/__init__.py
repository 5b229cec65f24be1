"""The model registry: Hugging Face configs and checkpoints of the MoE families expertd serves."""
