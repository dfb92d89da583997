"""A `multipart/form-data` upload (`POST /v1/files`): its fields and its one file, read with
python-multipart, the parser Starlette uses, within a size limit (413) and the body deadline."""

from __future__ import annotations

from dataclasses import dataclass, field

import python_multipart
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header

from zerohop.api.errors import ApiError
from zerohop.api.http.asgi import BodyDeadline, Receive, Scope, header, read_body


@dataclass(slots=True)
class Upload:
    fields: dict[str, str] = field(default_factory=dict)
    files: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # name -> (filename, data)


async def read_upload(scope: Scope, receive: Receive, limit: int, deadline: BodyDeadline) -> Upload:
    content_type = (header(scope, b"content-type") or b"").decode("latin-1")
    if not content_type.lower().startswith("multipart/form-data"):
        raise ApiError(415, f"content-type must be multipart/form-data, got {content_type!r}")
    body = await read_body(receive, limit, deadline, header(scope, b"content-encoding"))
    return parse(content_type, body, limit)


def parse(content_type: str, body: bytes, limit: int) -> Upload:
    upload = Upload()

    def on_field(part: python_multipart.multipart.Field) -> None:
        name = (part.field_name or b"").decode("utf-8", "replace")
        upload.fields[name] = (part.value or b"").decode("utf-8", "replace")

    def on_file(part: python_multipart.multipart.File) -> None:
        name = (part.field_name or b"").decode("utf-8", "replace")
        filename = (part.file_name or b"upload").decode("utf-8", "replace")
        part.file_object.seek(0)
        upload.files[name] = (filename, part.file_object.read())

    config = {"MAX_MEMORY_FILE_SIZE": limit + 1}  # the body is in memory already: no spill
    mime, options = parse_options_header(content_type)
    try:
        boundary = options.get(b"boundary")
        parser = python_multipart.FormParser(
            mime.decode("latin-1"), on_field, on_file, boundary=boundary, config=config
        )
        parser.write(body)
        parser.finalize()
    except (FormParserError, ValueError) as exc:
        raise ApiError(400, f"the multipart/form-data body cannot be read: {exc}") from None
    return upload
