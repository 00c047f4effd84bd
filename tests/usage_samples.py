"""Response bodies that report prompt-cache usage, for the usage reader's tests (unit and wire).

The ``DYNAMO_*`` bodies are real: captured from Dynamo 1.6.1's frontend with two mocker engines
(``--enable-anthropic-api``), the second request of one prompt (so its prefix was cached). The
builders below make the shapes Dynamo does not emit: OpenAI's own Responses stream (no
``[DONE]``), Anthropic's Messages stream (cache counts in ``message_start`` only), SGLang's
(``"usage": null`` in the chunks before the last; ``prompt_tokens_details`` only with
``--enable-cache-report``).
"""

from __future__ import annotations

from typing import Any

import orjson

# fmt: off
DYNAMO_CHAT_JSON = (
    b'{"id":"chatcmpl-6560594e-2fae-4408-ab7e-54dd06f8ac1a","choices":[{"index":0,"message":{"content":"w1161 w1416 w1409 w1895 w1772 w1128 w1184 w1318 ","refusal":null,"role":"assistant"},"finish_reason":"length","logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion","usage":{"prompt_tokens":726,"completion_tokens":8,"total_tokens":734,"prompt_tokens_details":{"cached_tokens":704}}}'
)

DYNAMO_CHAT_STREAM = (
    b'data: {"id":"chatcmpl-2d542477-6314-4c06-92f1-eb844dd159f4","choices":[{"index":0,"delta":{"content":"w1836 ","role":"assistant"},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk"}\n'
    b'\n'
    b'data: {"id":"chatcmpl-2d542477-6314-4c06-92f1-eb844dd159f4","choices":[{"index":0,"delta":{"content":"w1063 "},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk"}\n'
    b'\n'
    b'data: {"id":"chatcmpl-2d542477-6314-4c06-92f1-eb844dd159f4","choices":[{"index":0,"delta":{"content":"w1243 "},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk"}\n'
    b'\n'
    b'data: {"id":"chatcmpl-2d542477-6314-4c06-92f1-eb844dd159f4","choices":[{"index":0,"delta":{"content":"w960 "},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk"}\n'
    b'\n'
    b'data: {"id":"chatcmpl-2d542477-6314-4c06-92f1-eb844dd159f4","choices":[{"index":0,"delta":{"content":"w1157 "},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk"}\n'
    b'\n'
    b'data: {"id":"chatcmpl-2d542477-6314-4c06-92f1-eb844dd159f4","choices":[{"index":0,"delta":{"content":"w1666 "},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk"}\n'
    b'\n'
    b'data: {"id":"chatcmpl-2d542477-6314-4c06-92f1-eb844dd159f4","choices":[{"index":0,"delta":{"content":"w1032 "},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk"}\n'
    b'\n'
    b'data: {"id":"chatcmpl-2d542477-6314-4c06-92f1-eb844dd159f4","choices":[{"index":0,"delta":{"content":"w1787 "},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk"}\n'
    b'\n'
    b'data: {"id":"chatcmpl-2d542477-6314-4c06-92f1-eb844dd159f4","choices":[{"index":0,"delta":{},"finish_reason":"length","logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk"}\n'
    b'\n'
    b'data: {"id":"chatcmpl-2d542477-6314-4c06-92f1-eb844dd159f4","choices":[],"created":1796422841,"model":"tiny","object":"chat.completion.chunk","usage":{"prompt_tokens":726,"completion_tokens":8,"total_tokens":734,"prompt_tokens_details":{"cached_tokens":704}}}\n'
    b'\n'
    b'data: [DONE]\n'
    b'\n'
)

DYNAMO_CHAT_STREAM_CONTINUOUS = (
    b'data: {"id":"chatcmpl-bf8895ff-934f-4997-99e8-4a1475359e84","choices":[{"index":0,"delta":{"content":"w1659 ","role":"assistant"},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk","usage":{"prompt_tokens":726,"completion_tokens":1,"total_tokens":727,"prompt_tokens_details":{"cached_tokens":704}}}\n'
    b'\n'
    b'data: {"id":"chatcmpl-bf8895ff-934f-4997-99e8-4a1475359e84","choices":[{"index":0,"delta":{"content":"w948 "},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk","usage":{"prompt_tokens":726,"completion_tokens":2,"total_tokens":728,"prompt_tokens_details":{"cached_tokens":704}}}\n'
    b'\n'
    b'data: {"id":"chatcmpl-bf8895ff-934f-4997-99e8-4a1475359e84","choices":[{"index":0,"delta":{"content":"w1390 "},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk","usage":{"prompt_tokens":726,"completion_tokens":3,"total_tokens":729,"prompt_tokens_details":{"cached_tokens":704}}}\n'
    b'\n'
    b'data: {"id":"chatcmpl-bf8895ff-934f-4997-99e8-4a1475359e84","choices":[{"index":0,"delta":{"content":"w1118 "},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk","usage":{"prompt_tokens":726,"completion_tokens":4,"total_tokens":730,"prompt_tokens_details":{"cached_tokens":704}}}\n'
    b'\n'
    b'data: {"id":"chatcmpl-bf8895ff-934f-4997-99e8-4a1475359e84","choices":[{"index":0,"delta":{"content":"w1048 "},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk","usage":{"prompt_tokens":726,"completion_tokens":5,"total_tokens":731,"prompt_tokens_details":{"cached_tokens":704}}}\n'
    b'\n'
    b'data: {"id":"chatcmpl-bf8895ff-934f-4997-99e8-4a1475359e84","choices":[{"index":0,"delta":{"content":"w1143 "},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk","usage":{"prompt_tokens":726,"completion_tokens":6,"total_tokens":732,"prompt_tokens_details":{"cached_tokens":704}}}\n'
    b'\n'
    b'data: {"id":"chatcmpl-bf8895ff-934f-4997-99e8-4a1475359e84","choices":[{"index":0,"delta":{"content":"w1263 "},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk","usage":{"prompt_tokens":726,"completion_tokens":7,"total_tokens":733,"prompt_tokens_details":{"cached_tokens":704}}}\n'
    b'\n'
    b'data: {"id":"chatcmpl-bf8895ff-934f-4997-99e8-4a1475359e84","choices":[{"index":0,"delta":{"content":"w1288 "},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk","usage":{"prompt_tokens":726,"completion_tokens":8,"total_tokens":734,"prompt_tokens_details":{"cached_tokens":704}}}\n'
    b'\n'
    b'data: {"id":"chatcmpl-bf8895ff-934f-4997-99e8-4a1475359e84","choices":[{"index":0,"delta":{},"finish_reason":"length","logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk","usage":{"prompt_tokens":726,"completion_tokens":8,"total_tokens":734,"prompt_tokens_details":{"cached_tokens":704}}}\n'
    b'\n'
    b'data: {"id":"chatcmpl-bf8895ff-934f-4997-99e8-4a1475359e84","choices":[],"created":1796422841,"model":"tiny","object":"chat.completion.chunk","usage":{"prompt_tokens":726,"completion_tokens":8,"total_tokens":734,"prompt_tokens_details":{"cached_tokens":704}}}\n'
    b'\n'
    b'data: [DONE]\n'
    b'\n'
)

DYNAMO_CHAT_STREAM_NO_USAGE = (
    b'data: {"id":"chatcmpl-c2a26414-660c-48e3-b5c5-97d27d05c337","choices":[{"index":0,"delta":{"content":"w946 ","role":"assistant"},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk"}\n'
    b'\n'
    b'data: {"id":"chatcmpl-c2a26414-660c-48e3-b5c5-97d27d05c337","choices":[{"index":0,"delta":{"content":"w1312 "},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk"}\n'
    b'\n'
    b'data: {"id":"chatcmpl-c2a26414-660c-48e3-b5c5-97d27d05c337","choices":[{"index":0,"delta":{"content":"w1185 "},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk"}\n'
    b'\n'
    b'data: {"id":"chatcmpl-c2a26414-660c-48e3-b5c5-97d27d05c337","choices":[{"index":0,"delta":{"content":"w1373 "},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk"}\n'
    b'\n'
    b'data: {"id":"chatcmpl-c2a26414-660c-48e3-b5c5-97d27d05c337","choices":[{"index":0,"delta":{"content":"w1617 "},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk"}\n'
    b'\n'
    b'data: {"id":"chatcmpl-c2a26414-660c-48e3-b5c5-97d27d05c337","choices":[{"index":0,"delta":{"content":"w1676 "},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk"}\n'
    b'\n'
    b'data: {"id":"chatcmpl-c2a26414-660c-48e3-b5c5-97d27d05c337","choices":[{"index":0,"delta":{"content":"w1853 "},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk"}\n'
    b'\n'
    b'data: {"id":"chatcmpl-c2a26414-660c-48e3-b5c5-97d27d05c337","choices":[{"index":0,"delta":{"content":"w1404 "},"finish_reason":null,"logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk"}\n'
    b'\n'
    b'data: {"id":"chatcmpl-c2a26414-660c-48e3-b5c5-97d27d05c337","choices":[{"index":0,"delta":{},"finish_reason":"length","logprobs":null}],"created":1796422841,"model":"tiny","object":"chat.completion.chunk"}\n'
    b'\n'
    b'data: [DONE]\n'
    b'\n'
)

DYNAMO_RESPONSES_JSON = (
    b'{"background":false,"created_at":1796422841,"id":"resp_78cdcbab0ea947b7b7be5d98609794d4","incomplete_details":{"reason":"max_output_tokens"},"max_output_tokens":8,"metadata":{},"model":"tiny","object":"response","output":[{"type":"message","content":[{"type":"output_text","annotations":[],"logprobs":[],"text":"w1254 w1575 w1241 w1549 w1845 w1732 w1899 w1378 "}],"id":"msg_256af05fd3f447e09fd2a1ca23db5551","role":"assistant","status":"incomplete"}],"parallel_tool_calls":true,"service_tier":"auto","status":"incomplete","temperature":1.0,"text":{"format":{"type":"text"}},"tool_choice":"auto","tools":[],"top_logprobs":0,"top_p":1.0,"truncation":"disabled","usage":{"input_tokens":707,"input_tokens_details":{"cached_tokens":0},"output_tokens":8,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":715},"billing":null,"completed_at":null,"conversation":null,"error":null,"instructions":null,"max_tool_calls":null,"previous_response_id":null,"prompt":null,"prompt_cache_key":null,"prompt_cache_retention":null,"reasoning":null,"safety_identifier":null,"presence_penalty":0.0,"frequency_penalty":0.0,"store":false}'
)

DYNAMO_RESPONSES_STREAM = (
    b'event: response.created\n'
    b'data: {"type":"response.created","sequence_number":0,"response":{"background":false,"billing":null,"conversation":null,"created_at":1796422841,"completed_at":null,"error":null,"id":"resp_73e9c0e577d24ed8990b3ed09d485421","incomplete_details":null,"instructions":null,"max_output_tokens":8,"max_tool_calls":null,"metadata":{},"model":"tiny","object":"response","output":[],"parallel_tool_calls":true,"previous_response_id":null,"prompt":null,"prompt_cache_key":null,"prompt_cache_retention":null,"reasoning":null,"safety_identifier":null,"service_tier":"auto","status":"in_progress","temperature":1.0,"text":{"format":{"type":"text"}},"tool_choice":"auto","tools":[],"top_logprobs":0,"top_p":1.0,"truncation":"disabled","usage":null,"presence_penalty":0.0,"frequency_penalty":0.0,"store":false}}\n'
    b'\n'
    b'event: response.in_progress\n'
    b'data: {"type":"response.in_progress","sequence_number":1,"response":{"background":false,"billing":null,"conversation":null,"created_at":1796422841,"completed_at":null,"error":null,"id":"resp_73e9c0e577d24ed8990b3ed09d485421","incomplete_details":null,"instructions":null,"max_output_tokens":8,"max_tool_calls":null,"metadata":{},"model":"tiny","object":"response","output":[],"parallel_tool_calls":true,"previous_response_id":null,"prompt":null,"prompt_cache_key":null,"prompt_cache_retention":null,"reasoning":null,"safety_identifier":null,"service_tier":"auto","status":"in_progress","temperature":1.0,"text":{"format":{"type":"text"}},"tool_choice":"auto","tools":[],"top_logprobs":0,"top_p":1.0,"truncation":"disabled","usage":null,"presence_penalty":0.0,"frequency_penalty":0.0,"store":false}}\n'
    b'\n'
    b'event: response.output_item.added\n'
    b'data: {"type":"response.output_item.added","sequence_number":2,"output_index":0,"item":{"type":"message","content":[],"id":"msg_8052f84d02d744ca8b1e70efcb2a892d","role":"assistant","status":"in_progress"}}\n'
    b'\n'
    b'event: response.content_part.added\n'
    b'data: {"type":"response.content_part.added","sequence_number":3,"item_id":"msg_8052f84d02d744ca8b1e70efcb2a892d","output_index":0,"content_index":0,"part":{"type":"output_text","annotations":[],"logprobs":[],"text":""}}\n'
    b'\n'
    b'event: response.output_text.delta\n'
    b'data: {"type":"response.output_text.delta","sequence_number":4,"item_id":"msg_8052f84d02d744ca8b1e70efcb2a892d","output_index":0,"content_index":0,"delta":"w1584 ","logprobs":[]}\n'
    b'\n'
    b'event: response.output_text.delta\n'
    b'data: {"type":"response.output_text.delta","sequence_number":5,"item_id":"msg_8052f84d02d744ca8b1e70efcb2a892d","output_index":0,"content_index":0,"delta":"w1054 ","logprobs":[]}\n'
    b'\n'
    b'event: response.output_text.delta\n'
    b'data: {"type":"response.output_text.delta","sequence_number":6,"item_id":"msg_8052f84d02d744ca8b1e70efcb2a892d","output_index":0,"content_index":0,"delta":"w1688 ","logprobs":[]}\n'
    b'\n'
    b'event: response.output_text.delta\n'
    b'data: {"type":"response.output_text.delta","sequence_number":7,"item_id":"msg_8052f84d02d744ca8b1e70efcb2a892d","output_index":0,"content_index":0,"delta":"w1382 ","logprobs":[]}\n'
    b'\n'
    b'event: response.output_text.delta\n'
    b'data: {"type":"response.output_text.delta","sequence_number":8,"item_id":"msg_8052f84d02d744ca8b1e70efcb2a892d","output_index":0,"content_index":0,"delta":"w1601 ","logprobs":[]}\n'
    b'\n'
    b'event: response.output_text.delta\n'
    b'data: {"type":"response.output_text.delta","sequence_number":9,"item_id":"msg_8052f84d02d744ca8b1e70efcb2a892d","output_index":0,"content_index":0,"delta":"w1538 ","logprobs":[]}\n'
    b'\n'
    b'event: response.output_text.delta\n'
    b'data: {"type":"response.output_text.delta","sequence_number":10,"item_id":"msg_8052f84d02d744ca8b1e70efcb2a892d","output_index":0,"content_index":0,"delta":"w1550 ","logprobs":[]}\n'
    b'\n'
    b'event: response.output_text.delta\n'
    b'data: {"type":"response.output_text.delta","sequence_number":11,"item_id":"msg_8052f84d02d744ca8b1e70efcb2a892d","output_index":0,"content_index":0,"delta":"w1851 ","logprobs":[]}\n'
    b'\n'
    b'event: response.output_text.done\n'
    b'data: {"type":"response.output_text.done","sequence_number":12,"item_id":"msg_8052f84d02d744ca8b1e70efcb2a892d","output_index":0,"content_index":0,"text":"w1584 w1054 w1688 w1382 w1601 w1538 w1550 w1851 ","logprobs":[]}\n'
    b'\n'
    b'event: response.content_part.done\n'
    b'data: {"type":"response.content_part.done","sequence_number":13,"item_id":"msg_8052f84d02d744ca8b1e70efcb2a892d","output_index":0,"content_index":0,"part":{"type":"output_text","annotations":[],"logprobs":[],"text":"w1584 w1054 w1688 w1382 w1601 w1538 w1550 w1851 "}}\n'
    b'\n'
    b'event: response.output_item.done\n'
    b'data: {"type":"response.output_item.done","sequence_number":14,"output_index":0,"item":{"type":"message","content":[{"type":"output_text","annotations":[],"logprobs":[],"text":"w1584 w1054 w1688 w1382 w1601 w1538 w1550 w1851 "}],"id":"msg_8052f84d02d744ca8b1e70efcb2a892d","role":"assistant","status":"incomplete"}}\n'
    b'\n'
    b'event: response.incomplete\n'
    b'data: {"type":"response.incomplete","sequence_number":15,"response":{"background":false,"billing":null,"conversation":null,"created_at":1796422841,"completed_at":null,"error":null,"id":"resp_73e9c0e577d24ed8990b3ed09d485421","incomplete_details":{"reason":"max_output_tokens"},"instructions":null,"max_output_tokens":8,"max_tool_calls":null,"metadata":{},"model":"tiny","object":"response","output":[{"type":"message","content":[{"type":"output_text","annotations":[],"logprobs":[],"text":"w1584 w1054 w1688 w1382 w1601 w1538 w1550 w1851 "}],"id":"msg_8052f84d02d744ca8b1e70efcb2a892d","role":"assistant","status":"incomplete"}],"parallel_tool_calls":true,"previous_response_id":null,"prompt":null,"prompt_cache_key":null,"prompt_cache_retention":null,"reasoning":null,"safety_identifier":null,"service_tier":"auto","status":"incomplete","temperature":1.0,"text":{"format":{"type":"text"}},"tool_choice":"auto","tools":[],"top_logprobs":0,"top_p":1.0,"truncation":"disabled","usage":{"input_tokens":707,"input_tokens_details":{"cached_tokens":704},"output_tokens":8,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":715},"presence_penalty":0.0,"frequency_penalty":0.0,"store":false}}\n'
    b'\n'
    b'data: [DONE]\n'
    b'\n'
)

DYNAMO_MESSAGES_JSON = (
    b'{"id":"msg_1994168d744c496ba621e75352ca45b4","type":"message","role":"assistant","content":[{"type":"text","text":"w1897 w1608 w1303 w1127 w1044 w1854 w1730 w1604 "}],"model":"tiny","stop_reason":"max_tokens","stop_sequence":null,"usage":{"input_tokens":16,"output_tokens":8,"cache_creation_input_tokens":0,"cache_read_input_tokens":704}}'
)

DYNAMO_MESSAGES_STREAM = (
    b'event: message_start\n'
    b'data: {"type":"message_start","message":{"id":"msg_be142e6b27b049cb85755451808c9fbf","type":"message","role":"assistant","content":[],"model":"tiny","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":232,"output_tokens":0,"cache_creation_input_tokens":0}}}\n'
    b'\n'
    b'event: content_block_start\n'
    b'data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}\n'
    b'\n'
    b'event: content_block_delta\n'
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"w1394 "},"usage":{"input_tokens":16,"output_tokens":1,"cache_creation_input_tokens":0,"cache_read_input_tokens":704,"total_tokens":721}}\n'
    b'\n'
    b'event: content_block_delta\n'
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"w1788 "},"usage":{"input_tokens":16,"output_tokens":2,"cache_creation_input_tokens":0,"cache_read_input_tokens":704,"total_tokens":722}}\n'
    b'\n'
    b'event: content_block_delta\n'
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"w924 "},"usage":{"input_tokens":16,"output_tokens":3,"cache_creation_input_tokens":0,"cache_read_input_tokens":704,"total_tokens":723}}\n'
    b'\n'
    b'event: content_block_delta\n'
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"w1043 "},"usage":{"input_tokens":16,"output_tokens":4,"cache_creation_input_tokens":0,"cache_read_input_tokens":704,"total_tokens":724}}\n'
    b'\n'
    b'event: content_block_delta\n'
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"w1474 "},"usage":{"input_tokens":16,"output_tokens":5,"cache_creation_input_tokens":0,"cache_read_input_tokens":704,"total_tokens":725}}\n'
    b'\n'
    b'event: content_block_delta\n'
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"w1226 "},"usage":{"input_tokens":16,"output_tokens":6,"cache_creation_input_tokens":0,"cache_read_input_tokens":704,"total_tokens":726}}\n'
    b'\n'
    b'event: content_block_delta\n'
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"w1565 "},"usage":{"input_tokens":16,"output_tokens":7,"cache_creation_input_tokens":0,"cache_read_input_tokens":704,"total_tokens":727}}\n'
    b'\n'
    b'event: content_block_delta\n'
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"w1495 "},"usage":{"input_tokens":16,"output_tokens":8,"cache_creation_input_tokens":0,"cache_read_input_tokens":704,"total_tokens":728}}\n'
    b'\n'
    b'event: content_block_stop\n'
    b'data: {"type":"content_block_stop","index":0}\n'
    b'\n'
    b'event: message_delta\n'
    b'data: {"type":"message_delta","delta":{"stop_reason":"max_tokens"},"usage":{"input_tokens":16,"output_tokens":8,"cache_creation_input_tokens":0,"cache_read_input_tokens":704}}\n'
    b'\n'
    b'event: message_stop\n'
    b'data: {"type":"message_stop"}\n'
    b'\n'
    b'data: [DONE]\n'
    b'\n'
)
# fmt: on

# What each captured body reports: (prompt, cached).
DYNAMO_COUNTS = {
    "DYNAMO_CHAT_JSON": (726, 704),
    "DYNAMO_CHAT_STREAM": (726, 704),
    "DYNAMO_CHAT_STREAM_CONTINUOUS": (726, 704),
    "DYNAMO_RESPONSES_JSON": (707, 0),
    "DYNAMO_RESPONSES_STREAM": (707, 704),
    "DYNAMO_MESSAGES_JSON": (720, 704),  # 16 uncached + 0 written + 704 read
    "DYNAMO_MESSAGES_STREAM": (720, 704),  # message_delta's (message_start's is an estimate)
}


def sse(obj: Any, event: str | None = None) -> bytes:
    head = b"event: %s\n" % event.encode() if event else b""
    return head + b"data: " + orjson.dumps(obj) + b"\n\n"


def chat_usage(prompt: int, cached: int | None) -> dict[str, Any]:
    details = None if cached is None else {"cached_tokens": cached}
    return {
        "prompt_tokens": prompt,
        "completion_tokens": 5,
        "total_tokens": prompt + 5,
        "prompt_tokens_details": details,
    }


def chat_json(usage: Any = None, text: str = "hello") -> bytes:
    body: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
    }
    if usage is not None:
        body["usage"] = usage
    return orjson.dumps(body)


def chat_stream(usage: Any = None, *, words: int = 8, text: str = "w ", null_usage: bool = False) -> bytes:
    """An OpenAI chat stream: ``words`` content chunks, the final chunk, the usage chunk when
    ``usage`` is given (``null_usage``: every chunk before it says ``"usage": null``, as
    SGLang's), then ``[DONE]``."""
    base: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m"}
    if null_usage:
        base["usage"] = None
    out = [sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})]
    out += [sse({**base, "choices": [{"index": 0, "delta": {"content": text}}]}) for _ in range(words)]
    out.append(sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    if usage is not None:
        out.append(sse({**base, "choices": [], "usage": usage}))
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


def responses_usage(prompt: int, cached: int | None) -> dict[str, Any]:
    details = None if cached is None else {"cached_tokens": cached}
    return {
        "input_tokens": prompt,
        "input_tokens_details": details,
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + 5,
    }


def responses_object(usage: Any, text: str = "hello", instructions: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": "resp_1",
        "object": "response",
        "status": "completed",
        "instructions": instructions,
        "output": [
            {"type": "message", "id": "msg_1", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
        ],
    }
    if usage is not None:
        out["usage"] = usage
    out["metadata"] = {}
    return out


def responses_stream(usage: Any, *, deltas: int = 8, text: str = "w ") -> bytes:
    """OpenAI's Responses stream: created, deltas, completed (with the whole response), no [DONE]."""
    created = {"type": "response.created", "response": responses_object(None, "")}
    out = [sse(created, "response.created")]
    out += [
        sse({"type": "response.output_text.delta", "delta": text}, "response.output_text.delta") for _ in range(deltas)
    ]
    done = {"type": "response.completed", "response": responses_object(usage, text * deltas)}
    out.append(sse(done, "response.completed"))
    return b"".join(out)


def anthropic_usage(uncached: int, read: int | None, written: int | None = 0) -> dict[str, Any]:
    out: dict[str, Any] = {"input_tokens": uncached, "output_tokens": 1}
    if written is not None:
        out["cache_creation_input_tokens"] = written
    if read is not None:
        out["cache_read_input_tokens"] = read
    return out


def anthropic_json(usage: Any, text: str = "hello") -> bytes:
    return orjson.dumps(
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "m",
            "content": [{"type": "text", "text": text}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": usage,
        }
    )


def anthropic_stream(start_usage: Any, delta_usage: Any, *, deltas: int = 8, text: str = "w ") -> bytes:
    """Anthropic's Messages stream: message_start (``start_usage``), a text block of ``deltas``
    deltas, message_delta (``delta_usage``), message_stop."""
    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": []}
    out = [sse({"type": "message_start", "message": {**message, "usage": start_usage}}, "message_start")]
    out.append(
        sse(
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
            "content_block_start",
        )
    )
    out += [
        sse(
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
            "content_block_delta",
        )
        for _ in range(deltas)
    ]
    out.append(sse({"type": "content_block_stop", "index": 0}, "content_block_stop"))
    out.append(
        sse({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": delta_usage}, "message_delta")
    )
    out.append(sse({"type": "message_stop"}, "message_stop"))
    return b"".join(out)


def chunked(payload: bytes, sizes: list[int]) -> bytes:
    """``payload`` framed as chunks of the given sizes (cycled), then the last chunk."""
    out, at, k = [], 0, 0
    while at < len(payload):
        size = sizes[k % len(sizes)]
        part = payload[at : at + size]
        out.append(b"%x\r\n%s\r\n" % (len(part), part))
        at += size
        k += 1
    return b"".join(out) + b"0\r\n\r\n"


def event_chunks(payload: bytes) -> list[bytes]:
    """``payload``'s events, each framed as one chunk (the body's last chunk not included)."""
    events = [e + b"\n\n" for e in payload.split(b"\n\n") if e]
    return [b"%x\r\n%s\r\n" % (len(e), e) for e in events]


def chunked_by_event(payload: bytes) -> bytes:
    """``payload`` framed one chunk per event (as servers that write each event do)."""
    return b"".join(event_chunks(payload)) + b"0\r\n\r\n"
