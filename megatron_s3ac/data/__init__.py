"""Prompt data: prompt sets, rows with images and their processor (``prompts``), the character vocabulary as an HF
tokenizer (``char_tokenizer``)."""
