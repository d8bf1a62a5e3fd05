"""Incomplete multipart uploads under a prefix: listed and aborted (the sweep of a crashed writer).

An upload that a killed writer never completed is no object: a listing does not show it, yet its
parts are stored (and billed) until someone aborts it. obstore has no call for these two requests
(ListMultipartUploads, AbortMultipartUpload), so they are made here with the standard library and
AWS Signature Version 4 (a few HMACs), with the credentials :func:`tierckpt.storage.s3.credentials`
found. Where those come from the client's own chain (instance metadata) there is nothing to sign
with here: the sweep is skipped, and the bucket's lifecycle rule expires such uploads (docs/object-storage.md).

The answer is XML from the configured server; it is parsed with the standard library's expat
parser, which refuses external entities.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from typing import Any

__all__ = ["Signer", "Upload", "abort_upload", "list_uploads"]

_EMPTY = hashlib.sha256(b"").hexdigest()
_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


@dataclass(frozen=True)
class Upload:
    key: str  # the full key in the bucket
    upload_id: str


@dataclass(frozen=True)
class Signer:
    """Signs requests to ``endpoint`` (path-style: ``endpoint/bucket/key``) for ``region``."""

    endpoint: str
    region: str
    access_key: str
    secret_key: str
    token: str | None = None

    @classmethod
    def of(cls, endpoint: str | None, region: str, keys: dict[str, Any]) -> Signer | None:
        """A signer, or None when the credentials are not in hand (the client's own chain, anonymous)."""
        if "access_key_id" not in keys:
            return None
        endpoint = (endpoint or f"https://s3.{region}.amazonaws.com").rstrip("/")
        return cls(endpoint, region, keys["access_key_id"], keys["secret_access_key"], keys.get("session_token"))

    def request(self, method: str, path: str, query: dict[str, str], timeout: float) -> bytes:
        """Send a signed request without a body; returns the answer's body (raises OSError)."""
        url = urllib.parse.urlsplit(self.endpoint)
        now = datetime.datetime.now(datetime.timezone.utc)
        stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        canonical_path = urllib.parse.quote(path, safe="/-_.~")
        canonical_query = "&".join(f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}" for k, v in sorted(query.items()))
        headers = {"host": url.netloc, "x-amz-content-sha256": _EMPTY, "x-amz-date": stamp}
        if self.token:
            headers["x-amz-security-token"] = self.token
        signed = ";".join(sorted(headers))
        canonical = "\n".join([method, canonical_path, canonical_query, *(f"{k}:{headers[k]}" for k in sorted(headers)), "", signed, _EMPTY])
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
        key = f"AWS4{self.secret_key}".encode()
        for part in (day, self.region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        headers["authorization"] = f"AWS4-HMAC-SHA256 Credential={self.access_key}/{scope}, SignedHeaders={signed}, Signature={signature}"
        full = f"{self.endpoint}{canonical_path}" + (f"?{canonical_query}" if canonical_query else "")
        request = urllib.request.Request(full, method=method, headers={k: v for k, v in headers.items() if k != "host"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:  # noqa: S310 - the configured endpoint only
                return bytes(answer.read())
        except urllib.error.HTTPError as exc:
            raise OSError(f"{method} {path}: HTTP {exc.code}") from None
        except urllib.error.URLError as exc:
            raise OSError(f"{method} {path}: {exc.reason}") from None


def list_uploads(signer: Signer, bucket: str, prefix: str, *, timeout: float = 30.0) -> list[Upload]:
    """The incomplete multipart uploads of keys under ``prefix`` (blocking)."""
    found: list[Upload] = []
    query = {"uploads": "", "prefix": prefix}
    while True:
        root = ElementTree.fromstring(signer.request("GET", f"/{bucket}", query, timeout))
        for item in root.iter(f"{_NS}Upload"):
            key, upload = item.findtext(f"{_NS}Key"), item.findtext(f"{_NS}UploadId")
            if key and upload:
                found.append(Upload(key, upload))
        if root.findtext(f"{_NS}IsTruncated") != "true":
            return found
        query = {"uploads": "", "prefix": prefix,
                 "key-marker": root.findtext(f"{_NS}NextKeyMarker") or "", "upload-id-marker": root.findtext(f"{_NS}NextUploadIdMarker") or ""}


def abort_upload(signer: Signer, bucket: str, upload: Upload, *, timeout: float = 30.0) -> None:
    """Abort ``upload``: its parts are freed (blocking)."""
    signer.request("DELETE", f"/{bucket}/{upload.key}", {"uploadId": upload.upload_id}, timeout)
