"""The shared test rig: an S3 server, a metering and fault-injecting proxy, a directory server,
`FailNth` (fail the N-th read/write/fsync/rename below tierflow's own I/O), `ForkServer` (a kill
loop's children, forked from one warm process) and `assert_resumes_exactly`, the resume
guarantee as a check to run against your own batchers.

Tests use it through the fixtures in tests/conftest.py; benchmarks and `tierflow demo` import
it directly. Nothing here is imported by the core package, and moto loads only in the
server's child process.
"""

from tierflow.testing.bandwidth import TokenBucket
from tierflow.testing.faults import FailNth, IOFault, fail_each
from tierflow.testing.fileserver import DirectoryServer, serve_directory
from tierflow.testing.killer import ForkServer
from tierflow.testing.proxy import Fault, FaultRule, LoopbackProxy, PathTraffic, RequestRecord, TrafficSnapshot
from tierflow.testing.proxyprocess import ProxyProcess
from tierflow.testing.distributed import free_port, gathered_stream
from tierflow.testing.resume import assert_resumes_exactly, assert_same_batches
from tierflow.testing.s3server import MotoS3Server, S3Endpoint, fake_credentials_env

__all__ = [
    "DirectoryServer",
    "FailNth",
    "Fault",
    "FaultRule",
    "ForkServer",
    "IOFault",
    "LoopbackProxy",
    "MotoS3Server",
    "PathTraffic",
    "ProxyProcess",
    "RequestRecord",
    "S3Endpoint",
    "TokenBucket",
    "TrafficSnapshot",
    "assert_resumes_exactly",
    "assert_same_batches",
    "fail_each",
    "fake_credentials_env",
    "free_port",
    "gathered_stream",
    "serve_directory",
]
