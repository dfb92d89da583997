"""Signatures of thoughts: each thinking block the server returns carries one, and a later
turn that sends the block back is checked against it, so that the prompt renders as the
model's own thought only what this deployment's model wrote for this tenant.

- A signature is `<key id>.<MAC>`, opaque to clients. The key id names one of the server's
  keys (zerohop.gateway.server_keys: in the key store, so every replica sharing it and
  every restart verify it, through rotations); the MAC is base64url HMAC-SHA256 under that
  key of the model's primary name, the tenant's name and the thought, each length-prefixed:
  a thought signed for one model or tenant does not verify for another.
- ZEROHOP_REASONING_SECRET, when set, is an operator key that signs instead of the store's
  (it never rotates; every replica needs the same one); the store's keys still verify what
  they signed until they expire.
- A thinking block that does not verify (a key id this deployment does not know or no
  longer keeps: another deployment, an expired key, a signature of another API; an edited
  thought; another model or tenant) is left out of the prompt. With `strict`
  (`--strict-thought-signatures`) it is refused: a 400, or a 529 to retry when its key could
  not be looked up because the key store is unreachable.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from zerohop.api.errors import ApiError
from zerohop.gateway.server_keys import Keyring, ServerKeys, SigningKey

PURPOSE = "thoughts"  # the key store's purpose of these keys
SECRET_ENV = "ZEROHOP_REASONING_SECRET"
_DOMAIN = b"zerohop thought v1"
RETRY_AFTER_S = 5

Verdict = Literal["verified", "unknown_key", "mismatch"]


def key_id_of(signature: str) -> str | None:
    """The key id a signature names; None for one that is not of this server's shape."""
    key_id, dot, _mac = signature.partition(".")
    return key_id if dot and key_id else None


def _part(text: str) -> bytes:
    data = text.encode("utf-8", "surrogatepass")  # a client's JSON may hold lone surrogates
    return len(data).to_bytes(8, "big") + data


@dataclass(slots=True, frozen=True)
class ThoughtSigner:
    """Signs and checks the thoughts of one request: for `model` and `tenant`, with the keys
    of `keyring` (None: none were read, as the request neither thinks nor sends a thought)."""

    keyring: Keyring | None
    model: str
    tenant: str
    strict: bool = False
    now: float = field(default_factory=time.time)  # when its signatures are checked

    def sign(self, thought: str) -> str:
        if self.keyring is None:
            raise RuntimeError("no signing key was read for this request")
        key = self.keyring.signing
        return f"{key.key_id}.{self._mac(key, thought)}"

    def check(self, thought: str, signature: str) -> Verdict:
        key_id = key_id_of(signature)
        key = None
        if key_id is not None and self.keyring is not None:
            key = self.keyring.find(key_id, self.now)
        if key is None:
            return "unknown_key"
        given = signature.partition(".")[2].encode("utf-8", "surrogatepass")
        same = hmac.compare_digest(self._mac(key, thought).encode(), given)
        return "verified" if same else "mismatch"

    def verified(self, thought: str, signature: str, at: str) -> bool:
        """Whether the thought verifies (it is then rendered); one that does not is left
        out, or refused when strict (`at`: the block's place, for the error)."""
        verdict = self.check(thought, signature)
        if verdict == "verified" or not self.strict:
            return verdict == "verified"
        if verdict == "unknown_key" and self.keyring is not None and not self.keyring.complete:
            message = f"{at}.signature: its key cannot be looked up now; retry"
            headers = [(b"retry-after", str(RETRY_AFTER_S).encode()), (b"x-should-retry", b"true")]
            raise ApiError(529, message, code="unavailable", headers=headers)
        reason = (
            "signed by a key this server does not know or no longer keeps"
            if verdict == "unknown_key"
            else "the thought, model or tenant is not the one signed"
        )
        raise ApiError(400, f"{at}.signature: invalid signature for this thinking block ({reason})")

    def _mac(self, key: SigningKey, thought: str) -> str:
        message = _DOMAIN + _part(self.model) + _part(self.tenant) + _part(thought)
        digest = hmac.new(key.secret, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


class ThoughtSignatures:
    """The server's thought signing: its keys, and whether a thought that does not verify is
    refused (`strict`) or left out."""

    def __init__(self, keys: ServerKeys | None = None, strict: bool = False) -> None:
        self.keys = keys if keys is not None else ServerKeys(None, PURPOSE)
        self.strict = strict

    async def signer(
        self, model: str, tenant: str, signatures: Iterable[str] = (), signs: bool = False
    ) -> ThoughtSigner:
        """The signer of one request that sends `signatures` back and, with `signs`, may
        answer with a thought; the keys are read only when either needs them."""
        ids = {k for k in map(key_id_of, signatures) if k is not None}
        ring = await self.keys.keyring(ids) if ids or signs else None
        return ThoughtSigner(ring, model, tenant, self.strict, self.keys.clock())
