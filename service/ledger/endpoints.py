"""The generation endpoints' paths, as requests, batch lines and the workers name them."""
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT)
