"""Generate the Python gRPC stubs for protos/tandem/v1/*.proto (the workers' protocol) and
protos/tandem/api/v1/*.proto (the client API) (the one command; never edit its output)."""

from __future__ import annotations

import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent / "protos"


def main() -> int:
    packages = (ROOT / "tandem" / "v1", ROOT / "tandem" / "api" / "v1")
    protos = sorted(str(p.relative_to(ROOT)) for package in packages for p in package.glob("*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={ROOT}", f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}", *protos]
    code = protoc.main(args)
    if code != 0:
        print(f"protoc failed with exit code {code}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
