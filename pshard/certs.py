"""``pshard certs``: a development CA and one certificate per node, made on first use and kept after.

    pshard certs --dir ./pshard-certs --host ps-0 ps/ps-0 worker/worker-0 chief/chief-0 admin
    pshard certs --dir ./pshard-certs --revoke worker-1      # add worker-1.pem's serial to crl.pem

Each NODE is ``ROLE`` or ``ROLE/NODE-ID``. What the certificates name, the files in DIR and when one is
made again: the CA's own module, common/security/ca.py, which this command is a thin front of.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from pshard.common.argtypes import int_range
from pshard.common.errors import ClusterConfigError
from pshard.common.security.ca import CRL_NAME, DEFAULT_DAYS, DEFAULT_DIR, MAX_DAYS, ensure, revoke
from pshard.common.security.identity import parse_identity


def main(argv: Sequence[str] | None = None, *, prog: str = "pshard certs") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0] if __doc__ else None,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Each NODE: ROLE or ROLE/NODE-ID, ROLE one of scheduler, ps, "
                                            "chief, worker, evaluator, admin. Certificates name it as "
                                            "spiffe://pshard/ROLE/NODE-ID.")
    parser.add_argument("nodes", metavar="NODE", nargs="*",
                        help="e.g. ps/ps-0 worker/worker-1 chief/chief-0 admin")
    parser.add_argument("--revoke", metavar="NAME", action="append", default=[],
                        help="revoke a certificate: its name in DIR (worker-1 for worker-1.pem) or a PEM "
                             "file (repeatable); adds it to DIR/crl.pem, which servers re-read at once")
    parser.add_argument("--dir", default=os.environ.get("PSHARD_CERTS_DIR", DEFAULT_DIR),
                        help="where the CA and certificates live "
                             f"(env PSHARD_CERTS_DIR, default ./{DEFAULT_DIR})")
    parser.add_argument("--host", action="append", default=[],
                        help="another host name or IP the nodes answer on (repeatable; localhost and "
                             "127.0.0.1 are always in)")
    parser.add_argument("--days", type=int_range(1, MAX_DAYS), default=DEFAULT_DAYS,
                        help=f"validity, 1..{MAX_DAYS} (default {DEFAULT_DAYS})")
    args = parser.parse_args(argv)
    if not args.nodes and not args.revoke:
        parser.error("name a NODE to certify or a certificate to --revoke")
    try:
        nodes = [parse_identity(n, "NODE") for n in args.nodes]
        for name, serial in revoke(args.dir, args.revoke).items() if args.revoke else ():
            print(f"revoked {name} (serial {serial:x}) in {Path(args.dir) / CRL_NAME}")
        made = ensure(args.dir, nodes, args.host, days=args.days)
    except ClusterConfigError as e:
        parser.error(str(e))
    except OSError as e:  # a read-only or full disk, a directory of another user: one line, no traceback
        where = e.filename or args.dir
        print(f"{prog}: error: --dir: cannot write {str(where)!r}: {e.strerror or e}", file=sys.stderr)
        return 2
    for identity, files in made.items():
        print(f"{identity.spiffe_id()}: {files.cert} {files.key} (CA {files.ca})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
