from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FileKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FILE_KIND_UNSPECIFIED: _ClassVar[FileKind]
    FILE_KIND_FILE: _ClassVar[FileKind]
    FILE_KIND_DIR: _ClassVar[FileKind]
    FILE_KIND_LINK: _ClassVar[FileKind]
    FILE_KIND_OTHER: _ClassVar[FileKind]

class OutputStream(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_STREAM_UNSPECIFIED: _ClassVar[OutputStream]
    OUTPUT_STREAM_STDOUT: _ClassVar[OutputStream]
    OUTPUT_STREAM_STDERR: _ClassVar[OutputStream]
FILE_KIND_UNSPECIFIED: FileKind
FILE_KIND_FILE: FileKind
FILE_KIND_DIR: FileKind
FILE_KIND_LINK: FileKind
FILE_KIND_OTHER: FileKind
OUTPUT_STREAM_UNSPECIFIED: OutputStream
OUTPUT_STREAM_STDOUT: OutputStream
OUTPUT_STREAM_STDERR: OutputStream

class RunJobRequest(_message.Message):
    __slots__ = ("checkpoint", "code", "name", "args", "env", "cwd", "allow_read", "allow_write", "package_dirs", "network", "timeout_ms", "memory_bytes", "max_output", "max_file_size", "packages", "functions", "profile", "stream_output", "report_files", "files", "collect", "collect_bytes", "collect_files", "transfer_bytes", "network_destinations")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    ALLOW_READ_FIELD_NUMBER: _ClassVar[int]
    ALLOW_WRITE_FIELD_NUMBER: _ClassVar[int]
    PACKAGE_DIRS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    MAX_FILE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PACKAGES_FIELD_NUMBER: _ClassVar[int]
    FUNCTIONS_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    STREAM_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    REPORT_FILES_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    COLLECT_FIELD_NUMBER: _ClassVar[int]
    COLLECT_BYTES_FIELD_NUMBER: _ClassVar[int]
    COLLECT_FILES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    NETWORK_DESTINATIONS_FIELD_NUMBER: _ClassVar[int]
    checkpoint: str
    code: str
    name: str
    args: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    cwd: str
    allow_read: _containers.RepeatedScalarFieldContainer[str]
    allow_write: _containers.RepeatedScalarFieldContainer[str]
    package_dirs: _containers.RepeatedScalarFieldContainer[str]
    network: bool
    timeout_ms: int
    memory_bytes: int
    max_output: int
    max_file_size: int
    packages: _containers.RepeatedScalarFieldContainer[str]
    functions: _containers.RepeatedScalarFieldContainer[str]
    profile: str
    stream_output: bool
    report_files: bool
    files: _containers.RepeatedCompositeFieldContainer[WorkspaceFile]
    collect: _containers.RepeatedScalarFieldContainer[str]
    collect_bytes: int
    collect_files: int
    transfer_bytes: int
    network_destinations: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, checkpoint: _Optional[str] = ..., code: _Optional[str] = ..., name: _Optional[str] = ..., args: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., cwd: _Optional[str] = ..., allow_read: _Optional[_Iterable[str]] = ..., allow_write: _Optional[_Iterable[str]] = ..., package_dirs: _Optional[_Iterable[str]] = ..., network: _Optional[bool] = ..., timeout_ms: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., max_output: _Optional[int] = ..., max_file_size: _Optional[int] = ..., packages: _Optional[_Iterable[str]] = ..., functions: _Optional[_Iterable[str]] = ..., profile: _Optional[str] = ..., stream_output: _Optional[bool] = ..., report_files: _Optional[bool] = ..., files: _Optional[_Iterable[_Union[WorkspaceFile, _Mapping]]] = ..., collect: _Optional[_Iterable[str]] = ..., collect_bytes: _Optional[int] = ..., collect_files: _Optional[int] = ..., transfer_bytes: _Optional[int] = ..., network_destinations: _Optional[_Iterable[str]] = ...) -> None: ...

class WorkspaceFile(_message.Message):
    __slots__ = ("path", "data")
    PATH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    path: str
    data: bytes
    def __init__(self, path: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class CollectedFiles(_message.Message):
    __slots__ = ("files", "left_out", "left_out_more")
    FILES_FIELD_NUMBER: _ClassVar[int]
    LEFT_OUT_FIELD_NUMBER: _ClassVar[int]
    LEFT_OUT_MORE_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[WorkspaceFile]
    left_out: _containers.RepeatedCompositeFieldContainer[LeftOut]
    left_out_more: int
    def __init__(self, files: _Optional[_Iterable[_Union[WorkspaceFile, _Mapping]]] = ..., left_out: _Optional[_Iterable[_Union[LeftOut, _Mapping]]] = ..., left_out_more: _Optional[int] = ...) -> None: ...

class LeftOut(_message.Message):
    __slots__ = ("path", "reason", "size")
    PATH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    path: str
    reason: str
    size: int
    def __init__(self, path: _Optional[str] = ..., reason: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class JobError(_message.Message):
    __slots__ = ("type", "message", "file", "line", "hint")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    HINT_FIELD_NUMBER: _ClassVar[int]
    type: str
    message: str
    file: str
    line: int
    hint: str
    def __init__(self, type: _Optional[str] = ..., message: _Optional[str] = ..., file: _Optional[str] = ..., line: _Optional[int] = ..., hint: _Optional[str] = ...) -> None: ...

class RunJobResponse(_message.Message):
    __slots__ = ("exit", "stdout", "stderr", "stdout_truncated", "stderr_truncated", "error", "duration_us", "python", "preloaded_modules", "sandbox_id", "backend", "host", "system_exit", "session_id", "step", "session_ended", "resumed_ms", "value", "files", "collected", "session_key", "resumed_from_step", "lost", "network")
    EXIT_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    STDOUT_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STDERR_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DURATION_US_FIELD_NUMBER: _ClassVar[int]
    PYTHON_FIELD_NUMBER: _ClassVar[int]
    PRELOADED_MODULES_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_EXIT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SESSION_ENDED_FIELD_NUMBER: _ClassVar[int]
    RESUMED_MS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    COLLECTED_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    exit: int
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    error: JobError
    duration_us: int
    python: str
    preloaded_modules: _containers.RepeatedScalarFieldContainer[str]
    sandbox_id: str
    backend: str
    host: HostStats
    system_exit: bool
    session_id: str
    step: int
    session_ended: bool
    resumed_ms: float
    value: JobValue
    files: WrittenFiles
    collected: CollectedFiles
    session_key: str
    resumed_from_step: int
    lost: bool
    network: NetworkReport
    def __init__(self, exit: _Optional[int] = ..., stdout: _Optional[str] = ..., stderr: _Optional[str] = ..., stdout_truncated: _Optional[bool] = ..., stderr_truncated: _Optional[bool] = ..., error: _Optional[_Union[JobError, _Mapping]] = ..., duration_us: _Optional[int] = ..., python: _Optional[str] = ..., preloaded_modules: _Optional[_Iterable[str]] = ..., sandbox_id: _Optional[str] = ..., backend: _Optional[str] = ..., host: _Optional[_Union[HostStats, _Mapping]] = ..., system_exit: _Optional[bool] = ..., session_id: _Optional[str] = ..., step: _Optional[int] = ..., session_ended: _Optional[bool] = ..., resumed_ms: _Optional[float] = ..., value: _Optional[_Union[JobValue, _Mapping]] = ..., files: _Optional[_Union[WrittenFiles, _Mapping]] = ..., collected: _Optional[_Union[CollectedFiles, _Mapping]] = ..., session_key: _Optional[str] = ..., resumed_from_step: _Optional[int] = ..., lost: _Optional[bool] = ..., network: _Optional[_Union[NetworkReport, _Mapping]] = ...) -> None: ...

class NetworkReport(_message.Message):
    __slots__ = ("refused_connections", "refused", "refused_lookups", "refused_names", "allowed_connections")
    REFUSED_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_NAMES_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    refused_connections: int
    refused: _containers.RepeatedCompositeFieldContainer[RefusedConnection]
    refused_lookups: int
    refused_names: _containers.RepeatedScalarFieldContainer[str]
    allowed_connections: int
    def __init__(self, refused_connections: _Optional[int] = ..., refused: _Optional[_Iterable[_Union[RefusedConnection, _Mapping]]] = ..., refused_lookups: _Optional[int] = ..., refused_names: _Optional[_Iterable[str]] = ..., allowed_connections: _Optional[int] = ...) -> None: ...

class RefusedConnection(_message.Message):
    __slots__ = ("address", "port", "count")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    address: str
    port: int
    count: int
    def __init__(self, address: _Optional[str] = ..., port: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class WrittenFiles(_message.Message):
    __slots__ = ("files", "truncated")
    FILES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[WrittenFile]
    truncated: bool
    def __init__(self, files: _Optional[_Iterable[_Union[WrittenFile, _Mapping]]] = ..., truncated: _Optional[bool] = ...) -> None: ...

class WrittenFile(_message.Message):
    __slots__ = ("path", "size")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class JobValue(_message.Message):
    __slots__ = ("text", "truncated", "data", "omitted")
    class DataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OMITTED_FIELD_NUMBER: _ClassVar[int]
    text: str
    truncated: bool
    data: _containers.ScalarMap[str, str]
    omitted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, text: _Optional[str] = ..., truncated: _Optional[bool] = ..., data: _Optional[_Mapping[str, str]] = ..., omitted: _Optional[_Iterable[str]] = ...) -> None: ...

class HostStats(_message.Message):
    __slots__ = ("calls", "replies", "junk", "forged", "host_errors", "wait_us")
    CALLS_FIELD_NUMBER: _ClassVar[int]
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    JUNK_FIELD_NUMBER: _ClassVar[int]
    FORGED_FIELD_NUMBER: _ClassVar[int]
    HOST_ERRORS_FIELD_NUMBER: _ClassVar[int]
    WAIT_US_FIELD_NUMBER: _ClassVar[int]
    calls: int
    replies: int
    junk: int
    forged: int
    host_errors: int
    wait_us: int
    def __init__(self, calls: _Optional[int] = ..., replies: _Optional[int] = ..., junk: _Optional[int] = ..., forged: _Optional[int] = ..., host_errors: _Optional[int] = ..., wait_us: _Optional[int] = ...) -> None: ...

class SessionStep(_message.Message):
    __slots__ = ("code", "name", "args", "timeout_ms", "max_output", "stream_output", "report_files", "files", "collect")
    CODE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    STREAM_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    REPORT_FILES_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    COLLECT_FIELD_NUMBER: _ClassVar[int]
    code: str
    name: str
    args: _containers.RepeatedScalarFieldContainer[str]
    timeout_ms: int
    max_output: int
    stream_output: bool
    report_files: bool
    files: _containers.RepeatedCompositeFieldContainer[WorkspaceFile]
    collect: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, code: _Optional[str] = ..., name: _Optional[str] = ..., args: _Optional[_Iterable[str]] = ..., timeout_ms: _Optional[int] = ..., max_output: _Optional[int] = ..., stream_output: _Optional[bool] = ..., report_files: _Optional[bool] = ..., files: _Optional[_Iterable[_Union[WorkspaceFile, _Mapping]]] = ..., collect: _Optional[_Iterable[str]] = ...) -> None: ...

class HostCall(_message.Message):
    __slots__ = ("call_id", "function", "args_json", "kwargs_json", "deadline_ms")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    function: str
    args_json: bytes
    kwargs_json: bytes
    deadline_ms: int
    def __init__(self, call_id: _Optional[int] = ..., function: _Optional[str] = ..., args_json: _Optional[bytes] = ..., kwargs_json: _Optional[bytes] = ..., deadline_ms: _Optional[int] = ...) -> None: ...

class HostReply(_message.Message):
    __slots__ = ("call_id", "result_json", "error")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    result_json: bytes
    error: str
    def __init__(self, call_id: _Optional[int] = ..., result_json: _Optional[bytes] = ..., error: _Optional[str] = ...) -> None: ...

class InteractRequest(_message.Message):
    __slots__ = ("job", "open_session", "step", "reply", "hibernate", "fork", "attach", "upload", "download", "list_files", "close")
    JOB_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    HIBERNATE_FIELD_NUMBER: _ClassVar[int]
    FORK_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_FIELD_NUMBER: _ClassVar[int]
    LIST_FILES_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    job: RunJobRequest
    open_session: RunJobRequest
    step: SessionStep
    reply: HostReply
    hibernate: HibernateSession
    fork: ForkSession
    attach: AttachSession
    upload: UploadChunk
    download: DownloadChunk
    list_files: ListFiles
    close: CloseSession
    def __init__(self, job: _Optional[_Union[RunJobRequest, _Mapping]] = ..., open_session: _Optional[_Union[RunJobRequest, _Mapping]] = ..., step: _Optional[_Union[SessionStep, _Mapping]] = ..., reply: _Optional[_Union[HostReply, _Mapping]] = ..., hibernate: _Optional[_Union[HibernateSession, _Mapping]] = ..., fork: _Optional[_Union[ForkSession, _Mapping]] = ..., attach: _Optional[_Union[AttachSession, _Mapping]] = ..., upload: _Optional[_Union[UploadChunk, _Mapping]] = ..., download: _Optional[_Union[DownloadChunk, _Mapping]] = ..., list_files: _Optional[_Union[ListFiles, _Mapping]] = ..., close: _Optional[_Union[CloseSession, _Mapping]] = ...) -> None: ...

class InteractEvent(_message.Message):
    __slots__ = ("call", "result", "output", "hibernated", "forked", "attached", "uploaded", "downloaded", "listed", "handed_over")
    CALL_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    HIBERNATED_FIELD_NUMBER: _ClassVar[int]
    FORKED_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_FIELD_NUMBER: _ClassVar[int]
    DOWNLOADED_FIELD_NUMBER: _ClassVar[int]
    LISTED_FIELD_NUMBER: _ClassVar[int]
    HANDED_OVER_FIELD_NUMBER: _ClassVar[int]
    call: HostCall
    result: RunJobResponse
    output: OutputChunk
    hibernated: SessionHibernated
    forked: SessionForked
    attached: SessionAttached
    uploaded: ChunkUploaded
    downloaded: ChunkDownloaded
    listed: FilesListed
    handed_over: SessionHandedOver
    def __init__(self, call: _Optional[_Union[HostCall, _Mapping]] = ..., result: _Optional[_Union[RunJobResponse, _Mapping]] = ..., output: _Optional[_Union[OutputChunk, _Mapping]] = ..., hibernated: _Optional[_Union[SessionHibernated, _Mapping]] = ..., forked: _Optional[_Union[SessionForked, _Mapping]] = ..., attached: _Optional[_Union[SessionAttached, _Mapping]] = ..., uploaded: _Optional[_Union[ChunkUploaded, _Mapping]] = ..., downloaded: _Optional[_Union[ChunkDownloaded, _Mapping]] = ..., listed: _Optional[_Union[FilesListed, _Mapping]] = ..., handed_over: _Optional[_Union[SessionHandedOver, _Mapping]] = ...) -> None: ...

class CloseSession(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionHandedOver(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class UploadChunk(_message.Message):
    __slots__ = ("path", "offset", "size", "data")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    size: int
    data: bytes
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class DownloadChunk(_message.Message):
    __slots__ = ("path", "offset", "length")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    length: int
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class ListFiles(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class ChunkUploaded(_message.Message):
    __slots__ = ("received", "error_type", "error_message", "error_field")
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    ERROR_TYPE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_FIELD_NUMBER: _ClassVar[int]
    received: int
    error_type: str
    error_message: str
    error_field: str
    def __init__(self, received: _Optional[int] = ..., error_type: _Optional[str] = ..., error_message: _Optional[str] = ..., error_field: _Optional[str] = ...) -> None: ...

class ChunkDownloaded(_message.Message):
    __slots__ = ("path", "offset", "size", "modified_ns", "data", "error_type", "error_message", "error_field")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MODIFIED_NS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ERROR_TYPE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    size: int
    modified_ns: int
    data: bytes
    error_type: str
    error_message: str
    error_field: str
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., modified_ns: _Optional[int] = ..., data: _Optional[bytes] = ..., error_type: _Optional[str] = ..., error_message: _Optional[str] = ..., error_field: _Optional[str] = ...) -> None: ...

class FilesListed(_message.Message):
    __slots__ = ("entries", "truncated", "error_type", "error_message", "error_field")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    ERROR_TYPE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[FileEntry]
    truncated: bool
    error_type: str
    error_message: str
    error_field: str
    def __init__(self, entries: _Optional[_Iterable[_Union[FileEntry, _Mapping]]] = ..., truncated: _Optional[bool] = ..., error_type: _Optional[str] = ..., error_message: _Optional[str] = ..., error_field: _Optional[str] = ...) -> None: ...

class FileEntry(_message.Message):
    __slots__ = ("name", "size", "kind")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    kind: FileKind
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., kind: _Optional[_Union[FileKind, str]] = ...) -> None: ...

class ForkSession(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionForked(_message.Message):
    __slots__ = ("fork_ms", "token", "error_type", "error_message")
    FORK_MS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ERROR_TYPE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    fork_ms: float
    token: str
    error_type: str
    error_message: str
    def __init__(self, fork_ms: _Optional[float] = ..., token: _Optional[str] = ..., error_type: _Optional[str] = ..., error_message: _Optional[str] = ...) -> None: ...

class AttachSession(_message.Message):
    __slots__ = ("token", "key", "take_over")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TAKE_OVER_FIELD_NUMBER: _ClassVar[int]
    token: str
    key: str
    take_over: bool
    def __init__(self, token: _Optional[str] = ..., key: _Optional[str] = ..., take_over: _Optional[bool] = ...) -> None: ...

class SessionAttached(_message.Message):
    __slots__ = ("session_id", "step", "key", "setup")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SETUP_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step: int
    key: str
    setup: RunJobRequest
    def __init__(self, session_id: _Optional[str] = ..., step: _Optional[int] = ..., key: _Optional[str] = ..., setup: _Optional[_Union[RunJobRequest, _Mapping]] = ...) -> None: ...

class HibernateSession(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionHibernated(_message.Message):
    __slots__ = ("hibernate_ms", "error_type", "error_message")
    HIBERNATE_MS_FIELD_NUMBER: _ClassVar[int]
    ERROR_TYPE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    hibernate_ms: float
    error_type: str
    error_message: str
    def __init__(self, hibernate_ms: _Optional[float] = ..., error_type: _Optional[str] = ..., error_message: _Optional[str] = ...) -> None: ...

class OutputChunk(_message.Message):
    __slots__ = ("stream", "data")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    stream: OutputStream
    data: str
    def __init__(self, stream: _Optional[_Union[OutputStream, str]] = ..., data: _Optional[str] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("checkpoint", "payload", "timeout_ms")
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    checkpoint: str
    payload: bytes
    timeout_ms: int
    def __init__(self, checkpoint: _Optional[str] = ..., payload: _Optional[bytes] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("envelope", "duration_us")
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    DURATION_US_FIELD_NUMBER: _ClassVar[int]
    envelope: bytes
    duration_us: int
    def __init__(self, envelope: _Optional[bytes] = ..., duration_us: _Optional[int] = ...) -> None: ...

class CapacityRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolState(_message.Message):
    __slots__ = ("ready", "target")
    READY_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    ready: int
    target: int
    def __init__(self, ready: _Optional[int] = ..., target: _Optional[int] = ...) -> None: ...

class CapacityResponse(_message.Message):
    __slots__ = ("slots", "busy", "draining", "isolated", "pools", "worker_name", "protocol", "sessions", "max_sessions", "problem")
    class PoolsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: PoolState
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[PoolState, _Mapping]] = ...) -> None: ...
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    ISOLATED_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    slots: int
    busy: int
    draining: bool
    isolated: bool
    pools: _containers.MessageMap[str, PoolState]
    worker_name: str
    protocol: int
    sessions: int
    max_sessions: int
    problem: str
    def __init__(self, slots: _Optional[int] = ..., busy: _Optional[int] = ..., draining: _Optional[bool] = ..., isolated: _Optional[bool] = ..., pools: _Optional[_Mapping[str, PoolState]] = ..., worker_name: _Optional[str] = ..., protocol: _Optional[int] = ..., sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., problem: _Optional[str] = ...) -> None: ...
