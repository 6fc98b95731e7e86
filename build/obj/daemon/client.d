build/obj/daemon/client.o: daemon/client.c proto/fdwire.h daemon/kvcd.h \
 kernels/block.h daemon/idmap.h daemon/pool.h daemon/backend.h \
 proto/wire.h build/gen/kvc.pb-c.h daemon/log.h
proto/fdwire.h:
daemon/kvcd.h:
kernels/block.h:
daemon/idmap.h:
daemon/pool.h:
daemon/backend.h:
proto/wire.h:
build/gen/kvc.pb-c.h:
daemon/log.h:
