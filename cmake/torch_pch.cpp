// The one source of tidepool_torch_pch (cmake/TidepoolTorchPch.cmake): an OBJECT library
// needs a source, and the precompiled <torch/torch.h> it builds is what the LibTorch
// targets reuse. Nothing in it is linked anywhere.
