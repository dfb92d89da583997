"""A compaction's summary, signed for the served model and the caller's tenant with the
server's thought-signing keys (api/serving/thought_signatures.py: the key store's, so it
verifies on every replica of a fleet and after a restart, through rotations).

- Responses' `encrypted_content` is `zhc1.<base64url summary>.<signature>`: opaque to
  clients (signed, not encrypted: it holds nothing the client did not send or receive).
- Messages' compaction block carries the summary as its `content` and the signature as its
  `signature`, as the API's block does.
- A blob or block that does not verify (edited, another tenant's or model's, a key this
  deployment does not keep) is a 400 naming where it is; a key that cannot be looked up
  because the store is unreachable is a 529 to retry.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable
from dataclasses import dataclass

from zerohop.api.errors import ApiError
from zerohop.api.serving.service import ServingContext
from zerohop.api.serving.thought_signatures import RETRY_AFTER_S, ThoughtSigner, key_id_of

PREFIX = "zhc1"
_DOMAIN = "zerohop compaction v1\n"  # a thought's signature never verifies as a summary's


def signature_of(blob: str) -> str | None:
    """The signature inside an `encrypted_content` blob; None for one not of this shape."""
    parts = blob.split(".", 2)
    return parts[2] if len(parts) == 3 and parts[0] == PREFIX else None


@dataclass(slots=True, frozen=True)
class Sealer:
    """Seals and opens the compactions of one request (its model and tenant)."""

    signer: ThoughtSigner

    def sign(self, summary: str) -> str:
        return self.signer.sign(_DOMAIN + summary)

    def seal(self, summary: str) -> str:
        text = base64.urlsafe_b64encode(summary.encode("utf-8", "surrogatepass"))
        return f"{PREFIX}.{text.rstrip(b'=').decode()}.{self.sign(summary)}"

    def verify(self, summary: str, signature: str, at: str) -> None:
        """Refuses a summary whose signature is not this server's for this tenant."""
        verdict = self.signer.check(_DOMAIN + summary, signature)
        if verdict == "verified":
            return
        ring = self.signer.keyring
        if verdict == "unknown_key" and ring is not None and not ring.complete:
            headers = [(b"retry-after", str(RETRY_AFTER_S).encode()), (b"x-should-retry", b"true")]
            message = f"{at}: its signing key cannot be looked up now; retry"
            raise ApiError(529, message, code="unavailable", headers=headers)
        raise ApiError(
            400,
            f"{at}: invalid compaction (not signed by this server for this organization and"
            " model, or edited since)",
            param=at,
        )

    def open(self, blob: object, at: str) -> str:
        """The summary sealed in `blob` (an `encrypted_content`)."""
        signature = signature_of(blob) if isinstance(blob, str) else None
        if signature is None or not isinstance(blob, str):
            raise ApiError(400, f"{at}: not a compaction this server wrote", param=at)
        encoded = blob.split(".", 2)[1]
        try:
            raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
            summary = raw.decode("utf-8", "surrogatepass")
        except (binascii.Error, ValueError):
            raise ApiError(400, f"{at}: not a compaction this server wrote", param=at) from None
        self.verify(summary, signature, at)
        return summary


async def sealer(ctx: ServingContext, tenant: str, signatures: Iterable[str] = ()) -> Sealer:
    """The request's sealer: the keys its carried `signatures` name, and the signing key."""
    ids = [s for s in signatures if key_id_of(s) is not None]
    signer = await ctx.thoughts.signer(ctx.model_name, tenant, ids, signs=True)
    return Sealer(signer)
