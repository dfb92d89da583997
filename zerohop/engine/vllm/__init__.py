"""vLLM's engine under zerohop's gateway: its v1 `AsyncLLM` in the API process (its EngineCore
process(es) under it), our scheduling policy inside its scheduler. Imported only when
`--engine vllm` runs; nothing else in zerohop imports vLLM. Imports the rest of the engine
(and zerohop.models, for a GGUF file as a folder); nothing in the engine imports it."""
