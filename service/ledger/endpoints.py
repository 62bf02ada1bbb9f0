"""The generation endpoints' paths, as requests, batch lines and the workers name them."""
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT)
# Shapes over the chat endpoint (service/ledger/responses.py, anthropic_shapes.py): their jobs run as CHAT
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
