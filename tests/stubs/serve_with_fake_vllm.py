"""Start the real serve session with the fake vLLM server first on the path:
``serve_with_fake_vllm.py FAKE_FLAGS --settings JSON`` (tests/test_engine_serve.py)."""

import os
import sys
from pathlib import Path

here = Path(__file__).parent
os.environ["FAKE_SERVE"] = sys.argv.pop(1)
os.environ["PYTHONPATH"] = os.pathsep.join([str(here / "fake_vllm_serve"), os.environ.get("PYTHONPATH", "")])
sys.path.insert(0, str(here / "fake_vllm_serve"))
from sm12x_bundle.enginecheck import serve_session  # noqa: E402

serve_session.main()
