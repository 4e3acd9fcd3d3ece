"""Where a DistributedOptimizer's gradients live and what they are called: the parameters it
reduces, their gradients' views into flat buckets (``engine.assign``'s fusion rule), and the
names their allreduces are matched by across ranks."""

import torch

from ..engine import assign
from .bridge import engine_meta, zeros


def dense_local(param_groups):
    """The groups' dense CPU and CUDA parameters that need gradients, each once, in order."""
    return list(dict.fromkeys(
        parameter for group in param_groups for parameter in group["params"]
        if parameter.requires_grad and parameter.device.type in ("cpu", "cuda")
        and parameter.layout == torch.strided))


def bucket_views(parameters, bucket_bytes):
    """Lay the ``parameters``' gradients out, in their order, in the engine's fused buckets of
    at most ``bucket_bytes`` (``engine.assign``), each bucket one flat zero tensor on
    its parameters' device.

    Returns:
        (views, buckets): parameter -> a view of the parameter's shape into its bucket, and
        the buckets as (tuple of parameters, flat tensor).
    """
    views, buckets = {}, []
    for indices in assign([engine_meta(parameter) for parameter in parameters], bucket_bytes):
        bucket = [parameters[index] for index in indices]
        flat = zeros(sum(parameter.numel() for parameter in bucket), bucket[0].dtype,
                     bucket[0].device)
        buckets.append((tuple(bucket), flat))
        offset = 0
        for parameter in bucket:
            views[parameter] = flat[offset:offset + parameter.numel()].view(parameter.shape)
            offset += parameter.numel()
    return views, buckets


def laid_out_again(reducer, parameters, whole_bytes):
    """Yield (views, buckets) anew for the ``parameters`` (those with views now), in the order
    the engine runs their allreduces; each is to be taken before the next is made. Buckets that
    start whole keep their order (reverse parameter order: the engine reduces each as one
    tensor) and are laid out again only where their size has changed (the autotuner moved the
    fusion threshold; ``whole_bytes()``: their size now)."""
    reducer.laid_out()
    alone = [parameter for parameter in parameters if reducer.bucket_of(parameter) is None]
    if alone:
        yield bucket_views(reducer.order(alone), reducer.fusion_threshold())
    whole = [parameter for parameter in parameters if reducer.bucket_of(parameter) is not None]
    if whole and whole_bytes() != reducer.whole_bytes:
        reducer.forget(whole)
        yield bucket_views(whole, whole_bytes())


def move_gradients(views):
    """Each parameter's dense gradient copied into its new view, which becomes its ``.grad``."""
    for parameter, view in views.items():
        grad = parameter.grad
        if grad is not None and grad.layout == torch.strided:
            view.copy_(grad)
            parameter.grad = view


def parameter_names(optimizer, named_parameters):
    if named_parameters is None:
        return generated_names(optimizer)
    pairs = list(named_parameters)
    if any(not isinstance(pair, tuple) or len(pair) != 2 for pair in pairs):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    names = [name for name, _ in pairs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: "
                         f"{', '.join(duplicates)}")
    by_parameter = {parameter: name for name, parameter in pairs}
    unnamed = [parameter for group in optimizer.param_groups for parameter in group["params"]
               if parameter not in by_parameter]
    if unnamed:
        raise ValueError(f"named_parameters was specified, but one or more model parameters were "
                         f"not named. Python object ids: {', '.join(str(id(p)) for p in unnamed)}")
    return by_parameter


def generated_names(optimizer, skip=()):
    names = {}
    for group_index, group in enumerate(optimizer.param_groups):
        for index, parameter in enumerate(group["params"]):
            if parameter not in skip:
                names[parameter] = f"allreduce.noname.{group_index}.{index}"
    return names
