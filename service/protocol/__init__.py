"""The wire: the JSON the API takes and gives, as plain Python (no Flask, no database, no torch).

Request bodies checked and normalised (`request_bodies`, `embeddings`, `structured_output`), the bodies built from a
job's result (`openai_completions`, `logprobs`, `embeddings`), the Responses and Anthropic Messages APIs as shapes
over the chat body (`openai_responses`, `anthropic_messages`), the SLA classes and `service_tier` (`sla_classes`) and
the API's error type (`errors`). The Flask routes, the ledger (batch lines) and the workers (engine requests and batch
result files) share it; it imports nothing else of the project (tests/service/test_isolation_meta.py).

The endpoints' paths, as requests, batch lines and the workers name them, are defined here."""
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"          # embeddings.py
ENDPOINTS = (COMPLETIONS, CHAT, EMBEDDINGS)
# Shapes over the chat endpoint (openai_responses.py, anthropic_messages.py): their jobs run as CHAT
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
