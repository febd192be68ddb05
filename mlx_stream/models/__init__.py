"""Models: the registry, resolving and loading, GGUF conversion, Hugging Face ids."""
