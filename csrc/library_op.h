// The typed dispatcher handle of one of this library's ops, for C++ code that calls them (composites, autograd nodes):
// library_op<Signature>("transformer_fp8::fp8_gemm"). Look it up once (a function-local static) and .call() it.
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>

namespace tfp8 {

template <class Signature>
c10::TypedOperatorHandle<Signature> library_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace tfp8
