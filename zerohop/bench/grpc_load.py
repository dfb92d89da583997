"""`zerohop bench --endpoint grpc`: the same load over gRPC `Generate` (`--url grpc://H:P`).

Prompts are token ids (`prompt_token_ids`), as on the completions endpoint. A token event
is a streamed message that carries token ids (zerohop sends one per engine step); output
and prompt tokens come from the last message's usage. The key goes as `authorization`
metadata. There is no model listing over gRPC, so `--model` is required.
"""

from __future__ import annotations

import time

import grpc

from zerohop.bench.load_types import BenchConfig, Request, RequestResult, StreamTimes
from zerohop.bench.prompts import make_prompts, output_lengths
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc


class GrpcLoadClient:
    def __init__(self, cfg: BenchConfig) -> None:
        if not cfg.model:
            raise ValueError("--endpoint grpc needs --model (gRPC has no model listing)")
        self.cfg = cfg
        target = cfg.url.split("://", 1)[-1].rstrip("/")
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.ZerohopStub(self.channel)
        self.metadata = [("authorization", f"Bearer {cfg.api_key}")] if cfg.api_key else []

    async def requests(self, n: int, salt: str) -> list[Request]:
        prompts, outputs = make_prompts(self.cfg, n, salt), output_lengths(self.cfg, n, salt)
        pairs = zip(prompts, outputs, strict=True)
        return [Request(self._generate(p, out), len(p)) for p, out in pairs]

    def _generate(self, prompt: list[int], max_tokens: int) -> pb.GenerateRequest:
        cfg = self.cfg
        request = pb.GenerateRequest(model=cfg.model, max_tokens=max_tokens)
        request.prompt_token_ids.ids.extend(prompt)
        request.temperature = cfg.temperature
        request.ignore_eos = cfg.ignore_eos
        return request

    async def send(self, request: Request, bench_start: float) -> RequestResult:
        s = StreamTimes(time.perf_counter())
        call = self.stub.Generate(request.body, metadata=self.metadata, timeout=self.cfg.timeout_s)
        try:
            async for reply in call:
                if reply.token_ids:
                    s.token_event()
                if reply.finish_reason:
                    s.prompt_tokens = reply.usage.prompt_tokens
                    s.output_tokens = reply.usage.completion_tokens
        except grpc.aio.AioRpcError as exc:
            s.error = f"gRPC {exc.code().name}: {exc.details()}"
        return s.result(bench_start)

    async def close(self) -> None:
        await self.channel.close()
