"""The OpenAI surfaces (Chat Completions, Completions, models): wire shapes, reasoning, tools,
choices and SSE framing over api.conversation. Imports api.errors, api.conversation,
api.generation, api.http, api.serving, api.tools, gateway and the engine's types.
"""
