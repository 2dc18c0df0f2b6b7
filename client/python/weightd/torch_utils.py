"""Loading fetched shards into PyTorch modules without copying."""
import inspect

__all__ = ["load_into_module"]


def _supports_assign(module):
    try:
        return "assign" in inspect.signature(module.load_state_dict).parameters
    except (TypeError, ValueError):
        return False


def load_into_module(module, state, strict=True):
    """Loads a fetched state dict into `module` by *assigning* the tensors
    (no copy): the module's parameters and buffers become the fetched
    zero-copy tensors. Meant for modules built on the meta device.

    `state` is a ShardHandle (its state_dict() is used) or a {name: tensor}
    mapping. Parameters stay nn.Parameter and keep their requires_grad
    (floating-point tensors only; others get requires_grad=False); buffers
    are replaced by the tensors. Dtype and device come from the fetched
    tensors, as with `load_state_dict(..., assign=True)`.

    Returns torch's _IncompatibleKeys(missing_keys, unexpected_keys). Like
    load_state_dict: with strict=True missing or unexpected keys raise
    RuntimeError naming them; a shape mismatch always raises.

    On torch with `load_state_dict(assign=True)` (2.1+) that is called; on
    older torch (1.13) the same semantics are implemented here, including
    the module's state-dict pre/post hooks and `set_extra_state`.
    """
    if hasattr(state, "state_dict") and callable(state.state_dict) and \
            not isinstance(state, dict):
        state = state.state_dict()
    if _supports_assign(module):
        return module.load_state_dict(state, strict=strict, assign=True)
    return _load_assign(module, dict(state), strict)


def _load_assign(root, state_dict, strict):
    import torch
    from torch.nn.modules.module import _IncompatibleKeys

    metadata = getattr(state_dict, "_metadata", None)
    missing_keys, unexpected_keys, error_msgs = [], [], []

    def load_one(module, local_sd, prefix):
        local_metadata = {} if metadata is None else metadata.get(prefix[:-1], {})
        for hook in module._load_state_dict_pre_hooks.values():
            hook(local_sd, prefix, local_metadata, True, missing_keys, unexpected_keys,
                 error_msgs)
        persistent = {k: v for k, v in module._buffers.items()
                      if k not in module._non_persistent_buffers_set}
        local_state = {k: v for k, v in list(module._parameters.items()) + list(persistent.items())
                       if v is not None}
        for name, param in local_state.items():
            key = prefix + name
            if key not in local_sd:
                missing_keys.append(key)
                continue
            value = local_sd[key]
            if not torch.overrides.is_tensor_like(value):
                error_msgs.append('While copying the parameter named "{}", expected torch.Tensor '
                                  'or Tensor-like object from checkpoint but received {}'
                                  .format(key, type(value)))
                continue
            lazy = torch.nn.parameter.is_lazy(param)
            if not lazy and len(param.shape) == 0 and len(value.shape) == 1:
                value = value[0]  # the same backward-compatibility rule as torch
            if not lazy and value.shape != param.shape:
                error_msgs.append('size mismatch for {}: copying a param with shape {} from '
                                  'checkpoint, the shape in current model is {}.'
                                  .format(key, value.shape, param.shape))
                continue
            if name in module._parameters:
                if isinstance(value, torch.nn.Parameter):
                    new = value
                else:
                    grad = param.requires_grad and (value.is_floating_point() or
                                                    value.is_complex())
                    new = torch.nn.Parameter(value, requires_grad=grad)
                module._parameters[name] = new
            else:
                module._buffers[name] = value
        extra_key = prefix + "_extra_state"
        has_extra = type(module).set_extra_state is not torch.nn.Module.set_extra_state
        if has_extra:
            if extra_key in local_sd:
                module.set_extra_state(local_sd[extra_key])
            else:
                missing_keys.append(extra_key)
        for key in local_sd:
            if key.startswith(prefix) and not (has_extra and key == extra_key):
                first = key[len(prefix):].split(".", 1)[0]
                if first not in module._modules and first not in local_state:
                    unexpected_keys.append(key)
        for name, child in module._modules.items():
            if child is not None:
                child_prefix = prefix + name + "."
                load_one(child, {k: v for k, v in local_sd.items()
                                 if k.startswith(child_prefix)}, child_prefix)
        incompatible = _IncompatibleKeys(missing_keys, unexpected_keys)
        for hook in getattr(module, "_load_state_dict_post_hooks", {}).values():
            hook(module, incompatible)

    load_one(root, state_dict, "")

    if strict:
        if unexpected_keys:
            error_msgs.insert(0, "Unexpected key(s) in state_dict: {}. ".format(
                ", ".join('"{}"'.format(k) for k in unexpected_keys)))
        if missing_keys:
            error_msgs.insert(0, "Missing key(s) in state_dict: {}. ".format(
                ", ".join('"{}"'.format(k) for k in missing_keys)))
    if error_msgs:
        raise RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(
            root.__class__.__name__, "\n\t".join(error_msgs)))
    return _IncompatibleKeys(missing_keys, unexpected_keys)
