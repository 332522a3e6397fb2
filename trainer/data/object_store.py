"""Where shards live: a local folder or ``s3://bucket/prefix`` on any S3-compatible store.

Credentials, region, endpoint and CA come the standard way (docs/data.md, "Shards": object storage). The
store's answers become one line naming the source (`store_error`): wrong credentials, a missing
bucket or prefix, an endpoint that cannot be reached. boto3 retries what may pass (its standard
retry mode: throttling, 5xx, dropped connections) before the line is given."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

from trainer.infra.atomic import write_text_atomic
from trainer.infra.errors import UserError

S3 = "s3://"
#: The boto3 error codes that mean the credentials, not the request, are wrong.
_CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
                     "AccessDenied", "403", "InvalidClientTokenId", "UnrecognizedClientException"}
_MISSING_BUCKET_CODES = {"NoSuchBucket", "404"}


def is_remote(source: str) -> bool:
    return str(source).startswith(S3)


def join(source: str, *parts: str) -> str:
    """`source` / parts, for a folder or an ``s3://`` prefix alike."""
    if is_remote(source):
        return "/".join([str(source).rstrip("/"), *parts])
    return str(Path(source).joinpath(*parts))


#: boto3's retries: 5 attempts with its standard backoff, then the one line. LitData's own client
#: makes 1,000 adaptive attempts, which leaves a run waiting for a store that has gone for good.
RETRY_ATTEMPTS = 5


def _endpoint(endpoint_url: Optional[str]) -> dict[str, Any]:
    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
    return {"endpoint_url": endpoint} if endpoint else {}


def storage_options(endpoint_url: Optional[str]) -> dict[str, Any]:
    """LitData's ``storage_options`` (boto3 client arguments) for the store: its endpoint, and
    retries that end (`RETRY_ATTEMPTS`)."""
    from botocore.config import Config

    retries = Config(retries={"mode": "standard", "max_attempts": RETRY_ATTEMPTS}, connect_timeout=5,
                     read_timeout=30)
    return {**_endpoint(endpoint_url), "config": retries}


def _client(endpoint_url: Optional[str]) -> Any:
    import boto3

    # A session of its own: boto3's default session resolves the credentials once per process and
    # keeps them, so credentials changed since (or a forked run's new ones) would not be used.
    return boto3.session.Session().client("s3", **storage_options(endpoint_url))


def _bucket_key(url: str) -> tuple[str, str]:
    parsed = urlparse(url)
    return parsed.netloc, parsed.path.lstrip("/")


def store_error(source: str, ex: BaseException, endpoint_url: Optional[str] = None) -> UserError:
    """A store's refusal, as the one line that names `source` and says what to change."""
    from botocore.exceptions import (ClientError, EndpointConnectionError, NoCredentialsError,
                                     ConnectTimeoutError, ReadTimeoutError, SSLError)

    endpoint = _endpoint(endpoint_url).get("endpoint_url", "AWS's endpoint")
    if isinstance(ex, NoCredentialsError):
        return UserError(source, "no credentials for the store", "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                         "(or AWS_PROFILE) in the environment")
    if isinstance(ex, SSLError):
        return UserError(source, f"the TLS certificate of {endpoint} is not trusted ({ex})",
                         "AWS_CA_BUNDLE and SSL_CERT_FILE naming the store's CA file")
    if isinstance(ex, (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError)):
        return UserError(source, f"the store at {endpoint} cannot be reached (after retries)",
                         "a running store: data.endpoint_url (or AWS_ENDPOINT_URL) naming it")
    if isinstance(ex, ClientError):
        code = str(ex.response.get("Error", {}).get("Code", ""))
        if code in _CREDENTIAL_CODES:
            return UserError(source, f"the store refused the credentials ({code})",
                             "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY of a user allowed to read the bucket")
        if code in _MISSING_BUCKET_CODES:
            bucket, _ = _bucket_key(source)
            return UserError(source, f"bucket '{bucket}' does not exist at {endpoint}", "an existing bucket")
        return UserError(source, f"the store answered {code}: {ex}", "a readable s3://bucket/prefix")
    return UserError(source, f"{type(ex).__name__}: {ex}", "a readable s3://bucket/prefix")


def read_json(source: str, name: str, endpoint_url: Optional[str] = None) -> Optional[Any]:
    """`name` under `source` as JSON, or None when there is no such file."""
    if not is_remote(source):
        path = Path(source) / name
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = _bucket_key(join(source, name))
    try:
        body = _client(endpoint_url).get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as ex:
        if str(ex.response.get("Error", {}).get("Code", "")) in ("NoSuchKey",):
            return None
        raise store_error(source, ex, endpoint_url) from None
    except BotoCoreError as ex:
        raise store_error(source, ex, endpoint_url) from None
    return json.loads(body)


def write_json(dst: str, name: str, data: Any, endpoint_url: Optional[str] = None) -> None:
    """`data` as `name` under `dst`: a local file replaced atomically, or one PUT (atomic on S3)."""
    text = json.dumps(data, indent=1) + "\n"
    if not is_remote(dst):
        Path(dst).mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(dst) / name, text)
        return
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = _bucket_key(join(dst, name))
    try:
        _client(endpoint_url).put_object(Bucket=bucket, Key=key, Body=text.encode())
    except (ClientError, BotoCoreError) as ex:
        raise store_error(dst, ex, endpoint_url) from None


def check_reachable(source: str, endpoint_url: Optional[str] = None) -> None:
    """Stop in one line if the bucket of `source` cannot be read with these credentials."""
    if not is_remote(source):
        return
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _ = _bucket_key(source)
    try:
        _client(endpoint_url).head_bucket(Bucket=bucket)
    except (ClientError, BotoCoreError) as ex:
        raise store_error(source, ex, endpoint_url) from None
