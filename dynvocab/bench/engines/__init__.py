"""The other engines' rows of ``dynvocab bench``: Hugging Face ``generate`` (:mod:`.hf`), llama.cpp
(:mod:`.llamacpp`) and vLLM with and without the plugin's heads (:mod:`.vllm`)."""
