"""Settings for the whole test session."""

import os

# The Triton kernels are tested on CPU through Triton's interpreter, which must be selected before
# anything imports triton (bitsandbytes and transformers may, in other test modules).  This
# process never launches compiled kernels: there is no GPU in CI.
os.environ.setdefault("TRITON_INTERPRET", "1")
