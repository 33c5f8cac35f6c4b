"""Redis URLs: a cluster's or one server's, a node's, and the form fit to show.

``redis+cluster://host:port`` (``rediss+cluster://`` with TLS) names a Redis
Cluster by any one node; every other scheme is redis-py's own.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

# The schemes of a Redis Cluster URL, and the plain scheme of its nodes.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def node_url(url: str, host: str | None = None, port: int | None = None) -> str:
    """A plain URL of one node: the cluster URL's node, or ``host:port`` with the
    same scheme, credentials and options."""
    parts = urlsplit(url)
    scheme = CLUSTER_SCHEMES.get(parts.scheme, parts.scheme)
    netloc = parts.netloc
    if host is not None:
        auth = netloc.rpartition("@")[0]
        netloc = (auth + "@" if auth else "") + (f"[{host}]" if ":" in host else host) + f":{port}"
    return urlunsplit(parts._replace(scheme=scheme, netloc=netloc))


def redacted(url: str) -> str:
    """``url`` with its password, if it has one (``user:password@`` or a
    ``password=`` option), replaced by ``***``; everything else as written.

    Fit for an error message, a log line or a report. Never raises, so a URL
    too malformed to connect to can still be named in the error that says so.
    """
    scheme, sep, rest = url.partition("://")
    # The authority ends where urllib (and so redis-py) ends it.
    end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    auth, at, host = rest[:end].rpartition("@")
    user, colon, _password = auth.partition(":")
    if sep and at and colon:
        url = f"{scheme}://{user}:***@{host}{rest[end:]}"
    return _PASSWORD_OPTION.sub("***", url)


_PASSWORD_OPTION = re.compile(r"(?<=[?&]password=)[^&#]+")
