"""One generation driver under every surface: a request's whole life as typed events.

`driver.Generation` admits a planned request (output length, gateway, overload), runs it in the
engine, charges each step, reads each choice's output (thought, text, tool calls) and emits
`events`: admitted, ping, step (with a choice's finish and usage), failed. Messages, Chat and
Completions, Responses and gRPC encode those events into their wire shapes; `sse.send_stream`
is the one streamed-response loop of the HTTP surfaces.

May import: api.errors, api.serving (output_length, service), api.http,
api.conversation, zerohop.engine's client-side types, zerohop.gateway. Imported by
the surfaces (anthropic, openai, responses, grpc), never by them the other way.
"""
