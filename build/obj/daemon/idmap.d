build/obj/daemon/idmap.o: daemon/idmap.c daemon/idmap.h
daemon/idmap.h:
