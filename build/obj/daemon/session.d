build/obj/daemon/session.o: daemon/session.c kernels/compact.h \
 kernels/block.h daemon/kvcd.h daemon/idmap.h daemon/pool.h \
 daemon/backend.h proto/wire.h build/gen/kvc.pb-c.h daemon/log.h \
 daemon/policy/policy.h
kernels/compact.h:
kernels/block.h:
daemon/kvcd.h:
daemon/idmap.h:
daemon/pool.h:
daemon/backend.h:
proto/wire.h:
build/gen/kvc.pb-c.h:
daemon/log.h:
daemon/policy/policy.h:
