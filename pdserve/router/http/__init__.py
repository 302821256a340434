"""The OpenAI and Anthropic HTTP front end: the app, its schema, choices and waits."""
