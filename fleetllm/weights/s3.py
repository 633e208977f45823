"""A model's files on S3 or a compatible store (`AWS_ENDPOINT_URL`), requests signed with
Signature Version 4. Credentials come from `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`
[`AWS_SESSION_TOKEN`], a web identity (`AWS_WEB_IDENTITY_TOKEN_FILE` + `AWS_ROLE_ARN`, as EKS
IRSA sets them), or the container credentials endpoint (EKS Pod Identity); unsigned when none."""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import re
import urllib.parse
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from fleetllm.api.source import ModelSource
from fleetllm.weights.fetch import Listing, PullError, RemoteFile, Settings, get, wanted

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def check_bucket(source: ModelSource) -> None:
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", source.bucket):
        raise PullError(f"{source.uri!r}: {source.bucket!r} is not an S3 bucket name")


@dataclass(frozen=True)
class AwsCredentials:
    access_key: str
    secret_key: str
    token: str | None = None


def sigv4_headers(
    method: str,
    url: str,
    credentials: AwsCredentials,
    region: str,
    now: datetime.datetime,
    *,
    service: str = "s3",
    signed: dict[str, str] | None = None,
) -> dict[str, str]:
    """The headers that authenticate one request with AWS Signature Version 4 (empty body).
    `signed`: more headers to send and sign (Range, say)."""
    parts = urllib.parse.urlsplit(url)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    headers = {
        "host": parts.netloc,
        "x-amz-content-sha256": EMPTY_SHA256,
        "x-amz-date": amz_date,
        **{k.lower(): v.strip() for k, v in (signed or {}).items()},
    }
    if credentials.token:
        headers["x-amz-security-token"] = credentials.token
    names = sorted(headers)
    query = sorted(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    canonical = "\n".join(
        [
            method,
            urllib.parse.quote(urllib.parse.unquote(parts.path) or "/", safe="/~"),
            "&".join(f"{_uri(k)}={_uri(v)}" for k, v in query),
            "".join(f"{name}:{headers[name]}\n" for name in names),
            ";".join(names),
            EMPTY_SHA256,
        ]
    )
    scope = f"{day}/{region}/{service}/aws4_request"
    to_sign = "\n".join(
        ["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()]
    )
    key = f"AWS4{credentials.secret_key}".encode()
    for part in (day, region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={credentials.access_key}/{scope},"
        f"SignedHeaders={';'.join(names)},Signature={signature}"
    )
    del headers["host"]  # the HTTP client sends it
    return headers


def _uri(value: str) -> str:
    return urllib.parse.quote(value, safe="-_.~")


def aws_credentials(region: str, settings: Settings) -> AwsCredentials | None:
    """From the environment, a web identity (IRSA) or the container endpoint (Pod Identity)."""
    env = os.environ
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return AwsCredentials(
            env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], env.get("AWS_SESSION_TOKEN")
        )
    token_file, role = env.get("AWS_WEB_IDENTITY_TOKEN_FILE"), env.get("AWS_ROLE_ARN")
    if token_file and role:
        sts = env.get("AWS_ENDPOINT_URL_STS") or f"https://sts.{region}.amazonaws.com"
        query = urllib.parse.urlencode(
            {
                "Action": "AssumeRoleWithWebIdentity",
                "Version": "2011-06-15",
                "RoleArn": role,
                "RoleSessionName": env.get("AWS_ROLE_SESSION_NAME", "fleetllm-model-pull"),
                "WebIdentityToken": Path(token_file).read_text().strip(),
            }
        )
        root = ET.fromstring(get(f"{sts.rstrip('/')}/?{query}", lambda _u: {}, settings))
        found = {el.tag.rsplit("}", 1)[-1]: (el.text or "") for el in root.iter()}
        return AwsCredentials(found["AccessKeyId"], found["SecretAccessKey"], found["SessionToken"])
    uri = env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI")
    if uri:
        token = env.get("AWS_CONTAINER_AUTHORIZATION_TOKEN", "")
        if env.get("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"):
            token = Path(env["AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"]).read_text().strip()
        auth = {"Authorization": token} if token else {}
        doc = json.loads(get(uri, lambda _u: auth, settings))
        return AwsCredentials(doc["AccessKeyId"], doc["SecretAccessKey"], doc.get("Token"))
    return None


def _region() -> str:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


def bucket_url(source: ModelSource) -> str:
    """Where the bucket's objects are read (recorded in the folder's marker: another store's
    bucket of the same name holds other files)."""
    bucket, region = source.bucket, _region()
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        return f"{endpoint.rstrip('/')}/{bucket}"  # path style, as compatible stores expect
    if "." in bucket:
        return f"https://s3.{region}.amazonaws.com/{bucket}"
    return f"https://{bucket}.s3.{region}.amazonaws.com"


def list_s3(source: ModelSource, settings: Settings) -> Listing:
    prefix, region, base = source.key_prefix, _region(), bucket_url(source)
    credentials = aws_credentials(region, settings)

    def headers(url: str) -> dict[str, str]:
        if credentials is None:
            return {}
        now = datetime.datetime.now(datetime.UTC)
        return sigv4_headers("GET", url, credentials, region, now)

    files: list[RemoteFile] = []
    token: str | None = None
    while True:
        params = {"list-type": "2", "prefix": prefix}
        if token:
            params["continuation-token"] = token
        root = ET.fromstring(get(f"{base}/?{urllib.parse.urlencode(params)}", headers, settings))
        ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
        for item in root.iter(f"{ns}Contents"):
            key = item.findtext(f"{ns}Key") or ""
            name = key[len(prefix) :]
            if not wanted(name):
                continue
            etag = (item.findtext(f"{ns}ETag") or "").strip('"')
            # A multipart upload's ETag is no digest of the content: size alone then.
            checksum = ("md5", etag) if re.fullmatch(r"[0-9a-f]{32}", etag) else None
            size = int(item.findtext(f"{ns}Size") or 0)
            url = f"{base}/{urllib.parse.quote(key, safe='/~')}"
            files.append(RemoteFile(name, url, size, checksum))
        token = root.findtext(f"{ns}NextContinuationToken")
        if root.findtext(f"{ns}IsTruncated") != "true" or not token:
            break
    return Listing("", tuple(files), headers)
