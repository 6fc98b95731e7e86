/* cuda_fp16.h (emulation): see kvc_emu.h. */
#pragma once
#include "kvc_emu.h"
