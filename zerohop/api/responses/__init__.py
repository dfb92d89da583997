"""The OpenAI Responses surface (`/v1/responses`): items and tools in, output items and the
API's stream events out, stored responses in the key store. Imports api.conversation,
api.tools, api.http, api.openai (its request decoding and stream constants), api.errors,
api.generation, api.serving and gateway (its response store).
"""
