build/obj/daemon/main.o: daemon/main.c daemon/kvcd.h kernels/block.h \
 daemon/idmap.h daemon/pool.h daemon/backend.h proto/wire.h \
 build/gen/kvc.pb-c.h daemon/log.h
daemon/kvcd.h:
kernels/block.h:
daemon/idmap.h:
daemon/pool.h:
daemon/backend.h:
proto/wire.h:
build/gen/kvc.pb-c.h:
daemon/log.h:
