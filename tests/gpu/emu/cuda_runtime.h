/* cuda_runtime.h (emulation): see kvc_emu.h. */
#pragma once
#include "kvc_emu.h"
