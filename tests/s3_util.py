"""S3 for the tests: moto's standalone server on 127.0.0.1, a real S3 HTTP endpoint (``moto[server]``, dev extra).

- ``moto_s3`` (session): the endpoint URL of a server started for the run, stopped at its end. Skips, saying why,
  when moto is not installed; fails instead when the environment variable ``CI`` is set (CI installs it).
- ``s3_blob_url``: a fresh, empty bucket; the ``AWS_*`` variables obstore reads point at the server for the test
  (child processes inherit them); the value is ``s3://<bucket>/blobs``.
"""

from __future__ import annotations

import importlib
import logging
import os
import uuid
from collections.abc import Iterator

import httpx
import pytest

#: The environment of the fake S3 (moto takes any credentials).
MOTO_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true"}


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[str]:
    try:
        server_module = importlib.import_module("moto.server")
    except ImportError as exc:
        message = f"moto[server] is not installed (the dev extra): the S3 blob store tests need its server ({exc})"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI is set: it is required)")
        pytest.skip(message)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def make_bucket(endpoint: str) -> str:
    """A new empty bucket's name."""
    bucket = f"plancache-{uuid.uuid4().hex[:16]}"
    httpx.put(f"{endpoint}/{bucket}", timeout=10).raise_for_status()
    return bucket


@pytest.fixture
def s3_blob_url(moto_s3: str, monkeypatch: pytest.MonkeyPatch) -> str:
    for name, value in {**MOTO_ENV, "AWS_ENDPOINT_URL": moto_s3}.items():
        monkeypatch.setenv(name, value)
    return f"s3://{make_bucket(moto_s3)}/blobs"
