build/obj/daemon/pool.o: daemon/pool.c daemon/pool.h daemon/backend.h
daemon/pool.h:
daemon/backend.h:
