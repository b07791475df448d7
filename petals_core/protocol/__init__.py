"""The block RPCs' messages, shared by servers and clients.

Every call is one QUIC stream of the transport's RPC (see ``petals_core.transport``).  Methods:

- ``petals.info`` (:data:`INFO`, unary): :class:`InfoRequest` -> :class:`InfoReply`;
- ``petals.inference`` (:data:`INFERENCE`, stream): an inference session,
  :class:`OpenSession` -> :class:`SessionReady`, then each :class:`Step` -> :class:`StepResult`;
- ``petals.push`` (:data:`PUSH`, stream, server to server): :class:`OpenPush`, then steps of
  that session computed by the previous server of the client's route;
- ``petals.forward`` / ``petals.backward`` (:data:`FORWARD` / :data:`BACKWARD`, stream):
  fine-tuning passes, :class:`ForwardRequest` -> :class:`ForwardReply` and
  :class:`BackwardRequest` -> :class:`BackwardReply`, each a transfer of tensors in parts
  (:func:`send_tensors` / :func:`receive_tensors`).

Every message is a frozen class, checked when it is built (:class:`LocalProtocolError` for a
field of the wrong type or shape), with ``to_wire()`` and ``from_wire_untrusted(...)``; the
parsers raise :class:`CodecError` and nothing else.  They check the message alone: what
depends on the receiver's state (the blocks it holds, its limits, a session's position) the
receiver checks.

**Errors.**  A refused or failed call ends with the transport's error frame, which the caller
gets as :class:`RemoteError` (its ``remote_type`` and message).  The block RPCs refuse with
``ServerError`` (the request breaks a rule of this server or of the protocol; the message
names it), ``AllocationFailed`` (the cache cannot hold the session, now or within its
``alloc_timeout``), ``SessionTooLarge`` (a session larger than the server ever takes: longer
than its ``inference_max_length``, more rows than it batches, or more cache than it has),
``AdapterError`` (an adapter the server does not hold) and ``CodecError`` (a malformed session
opening).
"""

from ._inference import (
    INFERENCE as INFERENCE,
    MAX_PUSH_CHAIN as MAX_PUSH_CHAIN,
    PUSH as PUSH,
    PUSH_GRANTS as PUSH_GRANTS,
    PUSH_KEY_BYTES as PUSH_KEY_BYTES,
    OpenPush as OpenPush,
    OpenSession as OpenSession,
    PushTarget as PushTarget,
    SessionReady as SessionReady,
    Step as Step,
    StepResult as StepResult,
    push_grant as push_grant,
    push_granted as push_granted,
)
from ._info import INFO as INFO, InfoReply as InfoReply, InfoRequest as InfoRequest
from ._receipts import (
    FIRST_STEP as FIRST_STEP,
    Receipt as Receipt,
    ReceiptKind as ReceiptKind,
    Signature as Signature,
    SignedReceipt as SignedReceipt,
    digest_tensors as digest_tensors,
)
from ._reports import (
    REPORTED_KINDS as REPORTED_KINDS,
    FraudReport as FraudReport,
    StepEvidence as StepEvidence,
)
from ._training import (
    BACKWARD as BACKWARD,
    FORWARD as FORWARD,
    BackwardReply as BackwardReply,
    BackwardRequest as BackwardRequest,
    ForwardReply as ForwardReply,
    ForwardRequest as ForwardRequest,
)
from ._transfer import (
    DEFAULT_CHUNK_BYTES as DEFAULT_CHUNK_BYTES,
    MAX_TENSORS as MAX_TENSORS,
    receive_tensors as receive_tensors,
    send_tensors as send_tensors,
)
from ._wire import (
    MAX_ID_CHARS as MAX_ID_CHARS,
    TENSOR_DTYPES as TENSOR_DTYPES,
    prompts_fit as prompts_fit,
)
