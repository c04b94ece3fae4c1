"""The tokenizer service's gRPC side: its server (text in, text out), the client of the engine service
(one GenerateBatch stream per replica, or a Generate call per request), replica routing and the process wiring.
The text work it relays (tokenizer, detokenizer, stop strings, limits) lives one level up and imports no grpc."""
