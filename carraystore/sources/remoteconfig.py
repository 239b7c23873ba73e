"""Remote configuration: storage options -> an obstore store, and the source's knobs (layer 2).
:data:`SOURCE_OPTIONS` tune :class:`~carraystore.sources.remote.RemoteSource` itself
(:func:`split_options`); the rest go to :func:`make_object_store`. :func:`plain_http_url` is the
URL for Python's HTTP client in forked processes."""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from carraystore.base.errors import InvalidInputError, MissingDependencyError

__all__ = [
    "DEFAULT_MAX_INFLIGHT",
    "DEFAULT_TIMEOUT",
    "DEFAULT_RETRIES",
    "DEFAULT_RETRY_TIMEOUT",
    "DEFAULT_COALESCE_BYTES",
    "DEFAULT_READAHEAD_BYTES",
    "SOURCE_OPTIONS",
    "split_options",
    "make_object_store",
    "plain_http_url",
    "client_options",
]

#: Requests in flight: hides latency while ``max_inflight * chunk bytes >= bandwidth * round trip``.
DEFAULT_MAX_INFLIGHT = 16
#: Seconds one request may take (connect, headers and body) before it counts as failed.
DEFAULT_TIMEOUT = 30.0
#: Retries of a transient failure before the read fails (None: only ``retry_timeout`` decides).
DEFAULT_RETRIES: int | None = None
#: Seconds a failing request is retried from its first failure (a restarting storage node, several times).
DEFAULT_RETRY_TIMEOUT = 120.0
#: Largest GET made of adjacent ranges.
DEFAULT_COALESCE_BYTES = 4 << 20
#: Bytes fetched ahead and not yet asked for (the read-ahead's memory bound).
DEFAULT_READAHEAD_BYTES = 256 << 20

#: storage_options keys that tune the source itself (not passed to the object store).
SOURCE_OPTIONS = (
    "max_inflight",
    "timeout",
    "retries",
    "retry_timeout",
    "coalesce_bytes",
    "readahead_bytes",
    "connect_timeout",
)

_SCHEMES = ("s3", "s3a", "gs", "gcs", "http", "https", "file")


def split_options(storage_options: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(source knobs, object-store options) out of ``storage_options``."""
    opts = dict(storage_options or {})
    knobs = {k: opts.pop(k) for k in SOURCE_OPTIONS if k in opts}
    return knobs, opts


def _truthy(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


def _aws_has_credentials(config: Mapping[str, Any]) -> bool:
    if any(config.get(k) for k in ("access_key_id", "session_token", "role_arn", "web_identity_token_file")):
        return True
    env = os.environ
    return any(
        env.get(k)
        for k in (
            "AWS_ACCESS_KEY_ID",
            "AWS_PROFILE",
            "AWS_WEB_IDENTITY_TOKEN_FILE",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
            "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        )
    )


def client_options(knobs: Mapping[str, Any], client_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """obstore ``ClientConfig`` values: the timeouts of ``knobs`` and the ``client_kwargs`` obstore knows."""
    timeout = float(knobs.get("timeout", DEFAULT_TIMEOUT))
    connect = float(knobs.get("connect_timeout", min(10.0, timeout)))
    out: dict[str, Any] = {
        "allow_http": True,  # an http:// endpoint (a storage node on the LAN) works without flags
        "timeout": timedelta(seconds=timeout),
        "connect_timeout": timedelta(seconds=connect),
        "pool_idle_timeout": timedelta(seconds=60),
    }
    for k, v in client_kwargs.items():  # obstore ClientConfig keys given in client_kwargs
        if k not in ("endpoint_url", "region_name", "verify"):
            out[k] = v
    if client_kwargs.get("verify") is False:
        out["allow_invalid_certificates"] = True
    return out


def _import_obstore() -> Any:
    try:
        import obstore.store
    except ImportError as exc:  # pragma: no cover - obstore is in the remote and test extras
        raise MissingDependencyError(
            "reading stores from URLs needs obstore: pip install 'carraystore[remote]'"
        ) from exc
    return obstore.store


def make_object_store(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """An obstore store for ``url`` and the object's key in it.
    ``storage_options`` are fsspec-style (``endpoint_url``, ``key``, ``secret``, ``token``, ``anon``,
    ``region``, ``client_kwargs``); other keys go to obstore's configs, which also read ``AWS_*``.
    Without credentials anywhere, S3 requests are unsigned."""
    knobs, opts = split_options(storage_options)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise InvalidInputError(f"{url}: unsupported URL scheme {scheme!r}; use s3://, gs://, http(s):// or file://")
    st = _import_obstore()
    client_kwargs = dict(opts.pop("client_kwargs", None) or {})
    client = client_options(knobs, client_kwargs)
    for k in list(opts):  # ClientConfig keys given at the top level
        if k in (
            "allow_http",
            "allow_invalid_certificates",
            "proxy_url",
            "user_agent",
            "default_headers",
            "http2_only",
            "http1_only",
        ):
            client[k] = opts.pop(k)
    retry = {"max_retries": 0}  # retries are ours (carraystore.sources.retry): counted, logged, bounded in time
    anon = opts.pop("anon", None)
    provider = opts.pop("credential_provider", None)  # e.g. obstore.auth.boto3.Boto3CredentialProvider()
    extra = {"credential_provider": provider} if provider is not None else {}
    try:
        if scheme in ("s3", "s3a"):
            bucket, key = parts.netloc, unquote(parts.path.lstrip("/"))
            if not bucket or not key:
                raise InvalidInputError(f"{url}: an S3 URL is s3://bucket/key")
            config: dict[str, Any] = {}
            endpoint = opts.pop("endpoint_url", None) or client_kwargs.get("endpoint_url")
            if endpoint:
                config["endpoint"] = endpoint
            for fs_name, name in (
                ("key", "access_key_id"),
                ("secret", "secret_access_key"),
                ("token", "session_token"),
            ):
                if opts.get(fs_name) is not None:
                    config[name] = opts.pop(fs_name)
            region = opts.pop("region", None) or opts.pop("region_name", None) or client_kwargs.get("region_name")
            if region:
                config["region"] = region
            config.update(opts)
            if anon is None:
                anon = (
                    provider is None
                    and not _aws_has_credentials(config)
                    and not _truthy(config.get("skip_signature", False))
                )
                anon = anon or None
            if anon is not None:
                config["skip_signature"] = _truthy(anon) or _truthy(config.get("skip_signature", False))
            store = st.S3Store(bucket, config=config, client_options=client, retry_config=retry, **extra)
            return store, key
        if scheme in ("gs", "gcs"):
            bucket, key = parts.netloc, unquote(parts.path.lstrip("/"))
            if not bucket or not key:
                raise InvalidInputError(f"{url}: a GCS URL is gs://bucket/key")
            config = {}
            token = opts.pop("token", None)
            if token == "anon":
                anon = True
            elif isinstance(token, str) and token not in ("google_default", "cloud", "browser"):
                config["application_credentials"] = token
            opts.pop("project", None)
            config.update(opts)
            if anon:
                config["skip_signature"] = True
            return st.GCSStore(bucket, config=config, client_options=client, retry_config=retry, **extra), key
        if scheme in ("http", "https"):
            if opts:
                raise InvalidInputError(f"{url}: storage options {sorted(opts)} do not apply to HTTP URLs")
            path = parts.path
            if not path or path.endswith("/"):
                raise InvalidInputError(f"{url}: the URL must name a file")
            base, _, name = path.rpartition("/")
            store = st.HTTPStore.from_url(
                f"{scheme}://{parts.netloc}{base}/", client_options=client, retry_config=retry
            )
            return store, unquote(name)
        # file://
        path = unquote(parts.path)
        if parts.netloc and parts.netloc != "localhost":
            raise InvalidInputError(f"{url}: a file URL is file:///absolute/path")
        directory, _, name = path.rpartition("/")
        return st.LocalStore(directory or "/"), name
    except (InvalidInputError, MissingDependencyError):
        raise
    except Exception as exc:
        raise InvalidInputError(f"{url}: the storage options cannot be used ({type(exc).__name__}: {exc})") from exc


def plain_http_url(url: str, storage_options: Mapping[str, Any] | None = None) -> str | None:
    """The object's URL for an unsigned plain-HTTP GET (forked processes), or None when requests must be signed:
    ``http(s)://``, anonymous S3 (path-style, on the configured endpoint) and anonymous GCS."""
    _, opts = split_options(storage_options)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("http", "https"):
        return url
    client_kwargs = dict(opts.get("client_kwargs") or {})
    anon = opts.get("anon")
    if opts.get("credential_provider") is not None:
        return None
    if scheme in ("s3", "s3a"):
        config = {"access_key_id": opts.get("key"), "session_token": opts.get("token")}
        config.update({k: v for k, v in opts.items() if k in ("access_key_id", "role_arn", "web_identity_token_file")})
        if anon is None:
            anon = _truthy(
                opts.get("skip_signature", os.environ.get("AWS_SKIP_SIGNATURE", False))
            ) or not _aws_has_credentials(config)
        if not _truthy(anon):
            return None
        endpoint = (
            opts.get("endpoint_url")
            or opts.get("endpoint")
            or client_kwargs.get("endpoint_url")
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or os.environ.get("AWS_ENDPOINT")
        )
        if not endpoint:
            region = (
                opts.get("region")
                or client_kwargs.get("region_name")
                or os.environ.get("AWS_REGION")
                or os.environ.get("AWS_DEFAULT_REGION")
                or "us-east-1"
            )
            endpoint = f"https://s3.{region}.amazonaws.com"
        return f"{endpoint.rstrip('/')}/{parts.netloc}{quote(unquote(parts.path))}"
    if scheme in ("gs", "gcs"):
        if _truthy(anon) or opts.get("token") == "anon":
            return f"https://storage.googleapis.com/{parts.netloc}{quote(unquote(parts.path))}"
        return None
    return None
