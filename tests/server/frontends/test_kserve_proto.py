"""proto/inference is wire-compatible with Triton's protos as shipped in tritonclient 2.73.0.

Every message, field and enum value we declare must exist in Triton's descriptor with the same
number, type and cardinality; every RPC we declare must have Triton's path and message types. The
stubs live in a private descriptor pool, so tritonclient's stubs load next to them in one process.
"""
import subprocess
import sys

from google.protobuf import descriptor as descriptor_mod
from tritonclient.grpc import model_config_pb2 as triton_config
from tritonclient.grpc import service_pb2 as triton_service

from expertd.client import kserve_protos
from expertd.client.kserve_protos import model_config_pb2, service_pb2

REQUIRED_RPCS = {
    "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer",
    "ModelConfig", "ModelStatistics",
    "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
}


def _triton_message(full_name: str):
    for module in (triton_service, triton_config):
        try:
            return module.DESCRIPTOR.pool.FindMessageTypeByName(full_name)
        except KeyError:
            continue
    raise AssertionError(f"{full_name} is not a Triton message")


def _compare_message(ours: descriptor_mod.Descriptor, checked: list[str]) -> None:
    theirs = _triton_message(ours.full_name)
    for field in ours.fields:
        their_field = theirs.fields_by_name.get(field.name)
        assert their_field is not None, f"{ours.full_name}.{field.name} not in Triton's {theirs.full_name}"
        where = f"{ours.full_name}.{field.name}"
        assert field.number == their_field.number, where
        assert field.type == their_field.type, where
        assert field.is_repeated == their_field.is_repeated, where
        our_oneof, their_oneof = field.containing_oneof, their_field.containing_oneof
        assert (our_oneof and our_oneof.name) == (their_oneof and their_oneof.name), where
        if field.message_type is not None:
            assert field.message_type.full_name == their_field.message_type.full_name, where
        if field.enum_type is not None:
            assert field.enum_type.full_name == their_field.enum_type.full_name, where
            their_values = {v.name: v.number for v in their_field.enum_type.values}
            for value in field.enum_type.values:
                assert their_values.get(value.name) == value.number, f"{where}: enum value {value.name}"
        checked.append(where)
    for nested in ours.nested_types:
        _compare_message(nested, checked)


def test_every_declared_field_matches_triton():
    checked: list[str] = []
    for module in (service_pb2, model_config_pb2):
        for message in module.DESCRIPTOR.message_types_by_name.values():
            _compare_message(message, checked)
    assert len(checked) > 80  # the whole subset was walked, not an empty loop


def test_top_level_enum_matches_triton():
    ours = {v.name: v.number for v in model_config_pb2.DESCRIPTOR.enum_types_by_name["DataType"].values}
    theirs = {v.name: v.number for v in triton_config.DataType.DESCRIPTOR.values}
    assert ours == theirs


def test_service_methods_are_triton_paths_with_triton_types():
    ours = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs = triton_service.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert ours.full_name == kserve_protos.SERVICE_NAME == theirs.full_name
    assert {m.name for m in ours.methods} == REQUIRED_RPCS
    for method in ours.methods:
        their_method = theirs.methods_by_name[method.name]
        assert method.input_type.full_name == their_method.input_type.full_name
        assert method.output_type.full_name == their_method.output_type.full_name
        assert not method.client_streaming and not method.server_streaming


def test_messages_round_trip_through_tritonclient_classes():
    request = service_pb2.ModelInferRequest(model_name="moe-layer-0", model_version="1", id="req-7")
    request.parameters["expertd_return_routing"].bool_param = True
    tensor = request.inputs.add(name="hidden_states", datatype="BF16", shape=[3, 8])
    tensor.contents.fp32_contents.extend([1.5, -2.0])
    request.outputs.add(name="router_topk_ids")
    request.raw_input_contents.append(b"\x01\x02")
    theirs = triton_service.ModelInferRequest.FromString(request.SerializeToString())
    assert theirs.id == "req-7" and theirs.model_version == "1"
    assert theirs.parameters["expertd_return_routing"].bool_param is True
    assert list(theirs.inputs[0].shape) == [3, 8] and list(theirs.inputs[0].contents.fp32_contents) == [1.5, -2.0]
    assert theirs.outputs[0].name == "router_topk_ids" and theirs.raw_input_contents == [b"\x01\x02"]

    config = model_config_pb2.ModelConfig(name="moe-layer-0", platform="jax", max_batch_size=64)
    config.input.add(name="hidden_states", data_type=model_config_pb2.TYPE_BF16, dims=[8])
    config.dynamic_batching.preferred_batch_size.extend([16, 64])
    config.dynamic_batching.default_queue_policy.max_queue_size = 5
    config.instance_group.add(kind=model_config_pb2.ModelInstanceGroup.KIND_MODEL, count=1)
    back = triton_config.ModelConfig.FromString(config.SerializeToString())
    assert back.input[0].data_type == triton_config.TYPE_BF16 and list(back.input[0].dims) == [8]
    assert list(back.dynamic_batching.preferred_batch_size) == [16, 64]
    assert back.dynamic_batching.default_queue_policy.max_queue_size == 5
    assert back.instance_group[0].kind == triton_config.ModelInstanceGroup.KIND_MODEL


def test_stubs_live_in_a_private_pool():
    assert service_pb2.ModelInferRequest.DESCRIPTOR.file.pool is kserve_protos.POOL
    assert triton_service.ModelInferRequest.DESCRIPTOR.file.pool is not kserve_protos.POOL


def test_importing_the_generated_modules_directly_cannot_clash_with_tritonclient():
    # A fresh process: tritonclient's inference.* files first in the default pool, then our raw
    # generated modules imported by their own names (not through kserve_protos).
    code = ("from tritonclient.grpc import service_pb2 as theirs\n"
            "from expertd.client.pb.inference import grpc_service_pb2, grpc_service_pb2_grpc\n"
            "from expertd.client.kserve_pool import POOL\n"
            "from google.protobuf import descriptor_pool\n"
            "assert grpc_service_pb2.DESCRIPTOR.pool is POOL\n"
            "assert descriptor_pool.Default().FindMessageTypeByName('inference.ModelInferRequest') is "
            "theirs.ModelInferRequest.DESCRIPTOR\n"
            "print(grpc_service_pb2.ModelInferRequest(id='x').SerializeToString().hex())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert bytes.fromhex(out.stdout.strip()) == triton_service.ModelInferRequest(id="x").SerializeToString()
