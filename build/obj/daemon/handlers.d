build/obj/daemon/handlers.o: daemon/handlers.c daemon/kvcd.h \
 kernels/block.h daemon/idmap.h daemon/pool.h daemon/backend.h \
 proto/wire.h build/gen/kvc.pb-c.h daemon/log.h daemon/policy/policy.h
daemon/kvcd.h:
kernels/block.h:
daemon/idmap.h:
daemon/pool.h:
daemon/backend.h:
proto/wire.h:
build/gen/kvc.pb-c.h:
daemon/log.h:
daemon/policy/policy.h:
