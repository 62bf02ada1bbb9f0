"""The endpoints' paths (generation and embeddings), as requests, batch lines and the workers name them."""
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"          # service/ledger/embeddings.py
ENDPOINTS = (COMPLETIONS, CHAT, EMBEDDINGS)
# Shapes over the chat endpoint (service/ledger/responses.py, anthropic_shapes.py): their jobs run as CHAT
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
