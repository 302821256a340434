"""Chat prompts the SmolLM2 checks share: the token-exact test against transformers
(tests/e2e/test_smollm2.py) and the greedy-departure benchmark (benchmarks/quant_greedy.py).
"""
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three primary colors."}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Hello! Who are you?"},
     {"role": "assistant", "content": "I am SmolLM, an AI assistant."},
     {"role": "user", "content": "What can you do for me?"}],
    [{"role": "user", "content": "Translate 'good morning' into French."}],
]
