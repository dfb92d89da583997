"""The OpenAI surfaces (Chat Completions, Completions, models): wire shapes, reasoning, tools,
choices and SSE framing over api.conversation. Imports api.conversation, api.http, api.service.
"""
